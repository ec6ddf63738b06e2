"""The tiny local model: a Hugging Face directory that transformers loads, with a char-level
tokenizer that round-trips text (and that transformers' Qwen2 loader does not alter)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from laminar_core.cli import main
from laminar_core.models import build_tiny_model
from laminar_core.models.tiny import ALPHABET


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_directory_layout_and_config(tiny: Path) -> None:
    names = {p.name for p in tiny.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    assert cfg["vocab_size"] % 64 == 0
    assert (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1, 2)
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # vLLM CPU attention


def test_tokenizer_round_trips_and_matches_the_model(tiny: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"]
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and tok.bos_token_id == 1
    for text in ["c*13=", "a b  c\n\tx", ALPHABET]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids, skip_special_tokens=True) == text
    # every id the model can sample decodes; specials vanish with skip_special_tokens
    assert tok.decode([tok.eos_token_id, 5, 127], skip_special_tokens=True) == tok.decode([5])
    assert all(isinstance(tok.decode([i]), str) for i in range(cfg["vocab_size"]))


def test_model_loads_generates_and_is_seeded(tiny: Path, tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = model.generate(
        torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    assert out.shape[1] <= 7
    same = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    data = (tiny / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == data
    assert (other / "model.safetensors").read_bytes() != data


def test_cli_builds_it_and_rejects_bad_sizes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    assert main(["tiny-model", str(out), "--hidden-size", "64", "--heads", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["num_attention_heads"] == 2
    assert f"wrote {out}" in capsys.readouterr().out
    assert main(["tiny-model", str(tmp_path / "bad"), "--hidden-size", "100", "--heads", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "hidden_size (100) must be a multiple of heads (3)" in err
