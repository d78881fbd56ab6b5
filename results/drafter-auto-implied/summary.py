# python results/drafter-auto-implied/summary.py DIR/drafter.json: a `bench drafter --repeats` run as the README tables
import json,statistics as st,sys
d=json.load(open(sys.argv[1]))
for p,r in d['in_process']['runs'].items():
    a=r['auto']['repeats_tokens_per_s']; n=r['none']['repeats_tokens_per_s']
    ratios=[x/y for x,y in zip(a,n)]
    print(f"| {p} | {' '.join('%.2f'%x for x in n)} | {' '.join('%.2f'%x for x in a)} | **{st.median(a)/st.median(n):.3f}** | {st.median(ratios):.3f} | {' '.join('%.2f'%x for x in ratios)} | {r['auto']['identical']} |")
