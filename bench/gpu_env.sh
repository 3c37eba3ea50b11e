# Sourced at the start of a command on the GPU machine (`source bench/gpu_env.sh && python3 bench/...`), with
# .gpu-site.tgz (optuna, bitsandbytes, this checkout's transformers, Liger) and .whl/ (bench/data_site.py's
# TRL and datasets; bench/unsloth_recipe.py's Unsloth) carried: each is unpacked under /tmp/site-packages and
# all but Unsloth's go on PYTHONPATH before this checkout. The folder's name matters: `datasets` hashes each
# map function with dill, which pickles a module by value unless its file is under a site-packages path, and
# pyarrow's cannot be pickled (bench/data_site.py).
site=/tmp/site-packages
mkdir -p "$site"
for archive in .gpu-site.tgz .whl/*.t?z; do
  [ -f "$archive" ] && python3 -m tarfile -e "$archive" "$site"
done
export PYTHONPATH="$site/.gpu-site:$site/.data-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c "import optuna, bitsandbytes, trl, datasets" || echo "gpu_env: a carried package is missing (above)" >&2
