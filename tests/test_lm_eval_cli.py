"""lm-eval's command line, end to end, against a real server: a multiple-choice (loglikelihood)
and a generate-until task from local files, through `local-completions` (tokenizing with the
server's /tokenizer_info and /tokenize) and `sglang-generate`. Both must finish and score the
multiple-choice task the same, since both read the same prompt log-probabilities."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_utils import launch_server

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval[api]

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " London", " Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
]
TASKS = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
               "doc_to_target: answer\nmetric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_target: \"{{choices[0]}}\"\n"
                "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n",
}


def _write_tasks(root: Path) -> Path:
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, body in TASKS.items():
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")
    return tasks


@pytest.mark.slow  # ~4 minutes on the shared 2-core machine; test_dialects covers lm-eval's requests and parsers
@pytest.mark.timeout(600)
def test_lm_eval_runs_against_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = _write_tasks(tmp_path)
    scores = {}
    with launch_server(tiny_model_dir, "--num-pages", "2048") as s:
        for model, path, extra in [("local-completions", "/v1/completions", ""),
                                   ("sglang-generate", "/generate", f",tokenizer={tiny_model_dir}")]:
            out = tmp_path / model
            cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--tasks", "tiny_mc,tiny_gen",
                   "--include_path", str(tasks), "--output_path", str(out),
                   "--model_args", f"model={s.model},base_url={s.http}{path},num_concurrent=2,max_retries=1{extra}"]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                                 env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
            assert run.returncode == 0, run.stderr[-3000:]
            results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
            assert results["tiny_gen"]["exact_match,none"] >= 0
            scores[model] = results["tiny_mc"]["acc,none"]
    assert scores["local-completions"] == scores["sglang-generate"]
