"""The report of a run: `outputs.write_outputs` rebuilds trials.jsonl, best.json, report.md and the plots
from the probes; `lines` prints one probe per line (the live table); `markdown` writes report.md; `plots`
draws its pictures; `advice` says what to allow next when nothing fits."""
