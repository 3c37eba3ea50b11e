# Sourced at the start of a command on the GPU machine (`source bench/gpu_env.sh && python3 bench/...`), with
# .gpu-site.tgz (optuna, bitsandbytes, this checkout's transformers, Liger) and .whl/ (bench/data_site.py's
# TRL and datasets; bench/unsloth_recipe.py's Unsloth) carried: each is unpacked under /tmp/site-packages and
# all but Unsloth's go on PYTHONPATH before this checkout. The folder's name matters: `datasets` hashes each
# map function with dill, which pickles a module by value unless its file is under a site-packages path, and
# pyarrow's cannot be pickled (bench/data_site.py).
site=/tmp/site-packages
mkdir -p "$site"
# An archive already unpacked here (a warm machine's earlier call) is not unpacked again, so the bytecode compiled
# from it stays valid; what is unpacked is compiled at once, on every core, instead of by the first probe's imports.
fresh=
for archive in .gpu-site.tgz .whl/*.t?z; do
  [ -f "$archive" ] || continue
  stamp="$site/.$(basename "$archive").sha1"
  sum=$(sha1sum "$archive" | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$sum" ]; then
    python3 -m tarfile -e "$archive" "$site" && echo "$sum" > "$stamp" && fresh=1
  fi
done
[ -n "$fresh" ] && python3 -m compileall -q -j 0 "$site" >/dev/null 2>&1
export PYTHONPATH="$site/.gpu-site:$site/.data-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# TRL and datasets are checked only where .whl/data-site.txz came along (the Unsloth calls carry its own instead).
need="optuna, bitsandbytes"
[ -f .whl/data-site.txz ] && need="$need, trl, datasets"
python3 -c "import $need" || echo "gpu_env: a carried package is missing (above)" >&2
# The carried transformers must accept the machine's huggingface_hub (1.33 on the lent image: transformers 5.25
# wants >= 2.4, 5.24 does not); a mismatch makes every probe exit 1 at `import transformers`.
python3 -c "import transformers" 2>/dev/null || echo "gpu_env: the carried transformers does not import here;" \
  "repack .gpu-site.tgz with a transformers this image's huggingface_hub satisfies (5.24.0)" >&2
