# Sourced by the job scripts (after setting T0, R and O): t() stamps a stage into $O/log.txt,
# and MLX's CUDA build from the setup call goes on the path; LOCAL=1 keeps this machine's own
# MLX (a dry run of a script here). PY: the Python to run.
t() { echo "== $1 $(( $(date +%s) - T0 )) s" | tee -a $O/log.txt; }
[ -n "${LOCAL:-}" ] || [ -f /tmp/site/.ready ] || { echo "no /tmp/site: the setup call did not run on this machine"; exit 3; }
[ -n "${LOCAL:-}" ] || {
NV=$(python3 -c "import nvidia; print([p for p in nvidia.__path__ if 'site-packages' in p][0])")
export LD_LIBRARY_PATH=$(ls -d $NV/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/site:$R MACFLEET_NO_OPENBLAS=1; }
export PYTHONUNBUFFERED=1; PY=${PY:-python3}
