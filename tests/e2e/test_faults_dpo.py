"""Bad preference rows: each one a real `autofit data` process on a file holding that row (among good ones),
exit 2 with the file, the row's line, the field and what was expected, and no traceback. Nothing is skipped
silently: a bad row is an error, never a dropped pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from faults import Fault

GOOD = {"prompt": "What is 2 + 2?", "chosen": " 4.", "rejected": " 5."}
CHAT = [{"role": "user", "content": "Hi"}]

FAULTS = [
    Fault("dpo-missing-chosen", "a preference row without 'chosen'", "autofit data prefs.jsonl --model M", 2,
          "line 2: 'chosen' is missing"),
    Fault("dpo-empty-rejected", "a preference row whose 'rejected' is empty", "autofit data prefs.jsonl --model M",
          2, "line 2: 'rejected' is empty; expected its text"),
    Fault("dpo-wrong-type", "a 'chosen' that is a number", "autofit data prefs.jsonl --model M", 2,
          "line 2: 'chosen' is a number; expected text or a list of {role, content} messages"),
    Fault("dpo-same-completions", "'chosen' and 'rejected' the same", "autofit data prefs.jsonl --model M", 2,
          "'chosen' and 'rejected' are the same"),
    Fault("dpo-mixed-formats", "a text prompt with a conversation as 'chosen'", "autofit data prefs.jsonl --model M",
          2, "mixes text and conversations"),
    Fault("dpo-bad-message", "a message without 'content'", "autofit data prefs.jsonl --model M", 2,
          "'chosen' message 2 is not a {role, content} pair of strings"),
    Fault("dpo-unknown-role", "a message of role 'bot'", "autofit data prefs.jsonl --model M", 2,
          "has role 'bot'; expected one of system, user, assistant, tool"),
    Fault("dpo-not-an-object", "a row that is a JSON list", "autofit data prefs.jsonl --model M", 2,
          "line 2: expected a JSON object with 'chosen' and 'rejected', got a list"),
    Fault("dpo-no-completion", "no prompt, and 'chosen' is where 'rejected' starts",
          "autofit data prefs.jsonl --model M", 2, "'chosen' is the other's start with nothing after it"),
    Fault("dpo-formats-differ", "a row with a prompt after rows without one", "autofit data prefs.jsonl --model M",
          2, "differs from the first row's"),
    Fault("dpo-not-utf8", "a row in Latin-1, not UTF-8", "autofit data prefs.jsonl --model M", 2,
          "line 2 is not UTF-8"),
    Fault("dpo-search-bad-row", "a preference row without 'chosen', searched",
          "autofit search --dataset prefs.jsonl --space dpo", 2, "line 2: 'chosen' is missing"),
    Fault("dpo-search-sft-space", "preference pairs given to a space that trains SFT",
          "autofit search --dataset prefs.jsonl --space lora", 2, "holds preference pairs"),
    Fault("dpo-not-json", "a line that is not JSON", "autofit data prefs.jsonl --model M", 2,
          "row at line 2: not valid JSON; expected a JSON object with 'chosen' and 'rejected'"),
    Fault("dpo-search-length-drops-all", "a --max-length that every pair's prompt fills",
          "autofit search --dataset prefs.jsonl --space dpo --max-length 16", 2,
          "--max-length 16: every pair's prompt fills it, so TRL's DPOTrainer drops all 3 pairs"),
]

BAD_ROW: dict[str, object] = {
    "dpo-missing-chosen": {"prompt": "q", "rejected": "b"},
    "dpo-empty-rejected": {"prompt": "q", "chosen": "a", "rejected": "  "},
    "dpo-wrong-type": {"prompt": "q", "chosen": 5, "rejected": "b"},
    "dpo-same-completions": {"prompt": "q", "chosen": "a", "rejected": "a"},
    "dpo-mixed-formats": {"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
    "dpo-bad-message": {"prompt": CHAT, "chosen": [{"role": "assistant", "content": "a"}, {"role": "assistant"}],
                        "rejected": [{"role": "assistant", "content": "b"}]},
    "dpo-unknown-role": {"prompt": [{"role": "bot", "content": "q"}], "chosen": [{"role": "assistant",
                         "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
    "dpo-not-an-object": ["q", "a", "b"],
    "dpo-search-bad-row": {"prompt": "q", "rejected": "b"},
    "dpo-search-sft-space": GOOD,
}
DPO_SPACE = str(Path(__file__).resolve().parents[1] / "data" / "dpo-space.yaml")
SPACE = {"dpo-search-bad-row": DPO_SPACE, "dpo-search-sft-space": "cpu-demo", "dpo-search-length-drops-all": DPO_SPACE}
LONG_PROMPT = {"prompt": "Explain this. " * 20, "chosen": " Yes.", "rejected": " No."}


def _file(tmp_path: Path, fault: Fault) -> Path:
    path = tmp_path / "prefs.jsonl"
    if fault.id == "dpo-not-utf8":
        path.write_bytes((json.dumps(GOOD) + "\n").encode() + '{"prompt": "caf\u00e9", "chosen": "a", '
                         '"rejected": "b"}\n'.encode("latin-1"))
    elif fault.id == "dpo-not-json":
        path.write_text(json.dumps(GOOD) + "\n" + '{"prompt": "q", "chosen": "a",\n' + json.dumps(GOOD) + "\n")
    elif fault.id == "dpo-search-length-drops-all":  # prompts of ~60 tokens, --max-length 16
        path.write_text((json.dumps(LONG_PROMPT) + "\n") * 3)
    elif fault.id in ("dpo-no-completion", "dpo-formats-differ"):
        first = {"chosen": "Say hi. Hi!", "rejected": "Say hi. Go away."}
        second = ({"chosen": "Say hi.", "rejected": "Say hi. Hello."} if fault.id == "dpo-no-completion"
                  else GOOD)
        path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    else:
        path.write_text(json.dumps(GOOD) + "\n" + json.dumps(BAD_ROW[fault.id]) + "\n" + json.dumps(GOOD) + "\n")
    return path


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_a_bad_preference_row_is_a_clear_error(tmp_path: Path, fault: Fault) -> None:
    path = _file(tmp_path, fault)
    if fault.id in SPACE:  # the search reads --dataset before anything is created
        lengths = ["--max-length", "16"] if fault.id == "dpo-search-length-drops-all" else []
        proc = run_cli("search", "--model", "tiny-llama", "--device", "cpu", "--dataset", str(path), "--space",
                       SPACE[fault.id], *lengths, "--out", str(tmp_path / "runs"), cwd=tmp_path)
        assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    else:
        proc = run_cli("data", str(path), "--model", "tiny-llama", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == fault.exit_code, proc.stderr
    assert fault.message in proc.stderr, proc.stderr
    assert str(path) in proc.stderr and "Traceback" not in proc.stderr
