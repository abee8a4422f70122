"""The offline checkpoint builder: what it writes loads in transformers and behaves like Qwen3."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from minisgl_mp.tools import make_model
from minisgl_mp.tools.make_model import ModelShape, build_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
MakeCheckpoint = Callable[..., Path]  # see the make_checkpoint fixture in conftest.py

UNICODE_SAMPLES = [
    "Hello, world!",
    "你好，世界！今天天气很好。",
    "emoji 🎉👩‍👩‍👧 and flags 🇯🇵",
    "naïve café — ∑ x² ≤ ∞, Ω ≈ 3.14",
    "日本語とEnglishのmix\n\ttabs\r\nand  double  spaces ",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
]
GREEDY_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "你好，世界",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    # On a busy 2-core machine, two intra-op threads spin against each other: the tiny model's
    # generate() runs ~20x slower than with one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_model(path: Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], f"{kind}: {info[kind]}"
    return model.eval()


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def stored_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as weights:
            names |= set(weights.keys())
    return names


def test_default_checkpoint_loads_in_transformers_with_every_weight(
    tiny_model_dir: Path, tiny_config: dict[str, Any]
) -> None:
    model = load_model(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.num_key_value_heads == tiny_config["num_key_value_heads"]
    expected = set(ModelShape.from_config(tiny_config).tensor_shapes())
    assert stored_names(tiny_model_dir) == expected
    assert "lm_head.weight" not in expected  # tied: Qwen3 small models store no lm_head


def test_tokenizer_and_generation_config_agree_with_model_config(
    tiny_model_dir: Path, tiny_config: dict[str, Any]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    config = tiny_config
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", config["eos_token_id"])
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", config["pad_token_id"])
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == config["bos_token_id"]
    assert len(tokenizer) <= config["vocab_size"]
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [config["eos_token_id"], config["bos_token_id"]]


def test_same_seed_gives_byte_identical_files(tmp_path: Path, tiny_config: dict[str, Any]) -> None:
    # Both builds train the tokenizer from scratch, so this also covers its determinism.
    first = file_bytes(build_checkpoint(tiny_config, tmp_path / "a", seed=0))
    second = file_bytes(build_checkpoint(tiny_config, tmp_path / "b", seed=0))
    assert list(first) == list(second)
    for name in first:
        assert first[name] == second[name], f"{name} differs between two builds with the same seed"


def test_another_seed_changes_only_the_weights(make_checkpoint: MakeCheckpoint) -> None:
    seed0, seed1 = file_bytes(make_checkpoint()), file_bytes(make_checkpoint(seed=1))
    assert seed0["model.safetensors"] != seed1["model.safetensors"]
    assert seed0["tokenizer.json"] == seed1["tokenizer.json"]


def test_sharded_checkpoint_matches_hf_layout_and_single_file(make_checkpoint: MakeCheckpoint) -> None:
    single, sharded = make_checkpoint(), make_checkpoint(shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(path.name for path in sharded.glob("*.safetensors"))
    assert shard_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == shard_files
    assert set(index["weight_map"]) == stored_names(single)
    for name, filename in index["weight_map"].items():
        with safe_open(sharded / filename, framework="pt") as weights:
            assert name in weights.keys()
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in load_model(single).parameters())

    one, many = load_model(single).state_dict(), load_model(sharded).state_dict()
    assert one.keys() == many.keys()
    for name in one:
        assert torch.equal(one[name], many[name]), name


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": False, "num_key_value_heads": 1, "head_dim": 128},
        {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32, "num_hidden_layers": 2},
    ],
)
def test_other_shapes_load_and_give_finite_logits(
    make_checkpoint: MakeCheckpoint, overrides: dict[str, Any]
) -> None:
    path = make_checkpoint(overrides)
    model = load_model(path)
    assert ("lm_head.weight" in stored_names(path)) == (not overrides.get("tie_word_embeddings", True))
    with torch.no_grad():
        logits = model(torch.arange(100, 164)[None]).logits
    assert torch.isfinite(logits).all()


def test_long_prompt_gives_finite_logits(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    prompt = torch.randint(0, 8000, (1, 1000), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(prompt).logits
    assert torch.isfinite(logits).all()


def test_greedy_generation_is_varied_with_clear_winners(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir), AutoTokenizer.from_pretrained(str(tiny_model_dir))
    gaps = []
    for prompt in GREEDY_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=32, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        new_tokens = out.sequences[0, ids.shape[1] :].tolist()
        assert len(set(new_tokens)) >= 16, f"{prompt!r} -> {new_tokens}: greedy output repeats itself"
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    # Near-ties would make greedy comparisons against other implementations flaky.
    assert sum(gap > 0.1 for gap in gaps) >= 0.8 * len(gaps)


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_tokenizer_round_trips_unicode(tiny_model_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert raw.encode(text).ids == ids


def test_special_tokens_are_single_ids(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.eos_token_id


def test_chat_template_renders_qwen_format(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 你好"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi 你好<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nHi 你好<|im_end|>\n"


def test_tokenizer_loads_without_torch(tiny_model_dir: Path) -> None:
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from transformers import AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})\n"
        "text = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,"
        " add_generation_prompt=True)\n"
        "print(repr(text), tok.encode(text))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'" in done.stdout


def test_failed_rebuild_leaves_the_previous_model_intact(
    tmp_path: Path, tokenizer_dir: Path, tiny_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = build_checkpoint(tiny_config, tmp_path / "model", tokenizer_dir=tokenizer_dir)
    before = file_bytes(out)

    def crash_midway(tensors: dict[str, torch.Tensor], folder: Path, *args: Any) -> None:
        (folder / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(make_model, "write_weights", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        build_checkpoint(tiny_config, out, seed=1, tokenizer_dir=tokenizer_dir)
    with pytest.raises(KeyboardInterrupt):
        build_checkpoint(tiny_config, tmp_path / "fresh", tokenizer_dir=tokenizer_dir)
    assert file_bytes(out) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # no partial or staging folder


def test_config_ids_must_name_the_generated_special_tokens(
    tmp_path: Path, tiny_config: dict[str, Any]
) -> None:
    config = tiny_config | {"eos_token_id": 151645}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    assert make_model.main(["--config", str(config_path), "--out", str(tmp_path / "model")]) == 2
    assert not (tmp_path / "model").exists()


def test_makefile_command_line_builds_a_sharded_checkpoint(tmp_path: Path, tokenizer_dir: Path) -> None:
    command = [
        sys.executable, "-m", "minisgl_mp.tools.make_model",
        "--config", "configs/models/qwen3-tiny.json", "--out", str(tmp_path / "m"),
        "--shards", "2", "--tokenizer-dir", str(tokenizer_dir),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m" / "model-00002-of-00002.safetensors").is_file()
    assert (tmp_path / "m" / "tokenizer_config.json").is_file()


# Parameter counts from the model cards: (total, without embeddings and lm_head), in billions.
# (Llama's cards give the total only.)
PUBLISHED_SIZES = {
    "Qwen3-0.6B": (0.6, 0.44), "Qwen3-1.7B": (1.7, 1.4), "Qwen3-4B": (4.0, 3.6), "Qwen3-8B": (8.2, 6.95),
    "Qwen2.5-0.5B": (0.49, 0.36), "Qwen2.5-7B": (7.61, 6.53), "Qwen3-30B-A3B": (30.5, 29.9),
    "Llama-3.2-1B": (1.24, None), "Llama-3.1-8B": (8.03, None),
}  # fmt: skip
UNTIED = {"Qwen3-8B", "Qwen2.5-7B", "Qwen3-30B-A3B", "Llama-3.1-8B"}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_real_configs_have_the_published_sizes(name: str) -> None:
    config = json.loads((REPO_ROOT / "configs" / "models" / f"{name}.json").read_text())
    hf_config = AutoConfig.for_model(**config)
    assert type(hf_config).__name__.removesuffix("Config") + "ForCausalLM" == config["architectures"][0]
    assert hf_config.tie_word_embeddings == (name not in UNTIED)
    shapes = ModelShape.from_config(config).tensor_shapes()
    total = sum(math.prod(dims) for dims in shapes.values())
    vocab_tables = [key for key in shapes if key in ("model.embed_tokens.weight", "lm_head.weight")]
    body = total - sum(math.prod(shapes[key]) for key in vocab_tables)
    published_total, published_body = PUBLISHED_SIZES[name]
    assert total / 1e9 == pytest.approx(published_total, abs=0.05)
    if published_body is not None:
        assert body / 1e9 == pytest.approx(published_body, abs=0.05)


@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_arch_flag_builds_that_architecture_at_the_config_size(
    arch: str, cls: str, tmp_path: Path, tokenizer_dir: Path, tiny_config: dict[str, Any]
) -> None:
    out = tmp_path / arch
    assert make_model.main(["--arch", arch, "--out", str(out), "--tokenizer-dir", str(tokenizer_dir)]) == 0
    model = load_model(out)
    assert type(model).__name__ == cls
    assert model.config.hidden_size == tiny_config["hidden_size"]
    config = json.loads((out / "config.json").read_text())
    assert stored_names(out) == set(ModelShape.from_config(config).tensor_shapes())
