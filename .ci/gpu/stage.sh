#!/usr/bin/env bash
# Part calls: keep this call's parts on the machine (/tmp/stage), outside the copied tree;
# wheels (.gpu/w/*.whl, carried with the last part) go to /tmp/stage/w for setup.sh, and
# .gpu/w/pack.sha (the tar's sum) beside the parts.
mkdir -p /tmp/stage/w
for f in "$@"; do
  case $f in *.whl) cp "$f" /tmp/stage/w/ ;; *) cp "$f" /tmp/stage/ ;; esac
done
ls -la /tmp/stage /tmp/stage/w && df -h /tmp | tail -1
