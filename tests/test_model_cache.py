"""The GGUF -> Hugging Face conversion cache (model.load.convert_gguf): a cached load is the direct transformers load,
bit for bit (weights, tokenizer, chat template), and a damaged GGUF is never cached."""

from __future__ import annotations

import pytest
import torch

from nearpolicy.model import load as models


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NEARPOLICY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_cached_gguf_load_equals_the_direct_transformers_load(tiny_gguf_factory, cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = tiny_gguf_factory("q8_0")
    model, tokenizer = models.load_policy(str(gguf))
    folder = models.converted_folder(gguf)
    assert folder.parent == cache / "gguf-hf" and (folder / "model.safetensors").is_file()
    written = (folder / "model.safetensors").stat().st_mtime_ns
    again, tokenizer_again = models.load_policy(str(gguf))
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # read back, not converted again
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    direct_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    want = direct.state_dict()
    for got in (model.state_dict(), again.state_dict()):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 4 = ? ü 中文 🙂"}]
    text = "Hello world! 3.14159 <|im_end|> don't  tabs\tand 🙂"
    for tok in (tokenizer, tokenizer_again):
        assert tok(text).input_ids == direct_tokenizer(text).input_ids
        assert (tok.apply_chat_template(messages, add_generation_prompt=True)
                == direct_tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (direct_tokenizer.eos_token_id,
                                                                  direct_tokenizer.pad_token_id, len(direct_tokenizer))


def test_the_cache_key_follows_the_content_and_a_damaged_gguf_is_refused_uncached(tiny_gguf_factory, cache, tmp_path):
    gguf = tiny_gguf_factory("f32")
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf.read_bytes())
    assert models.converted_folder(copy) == models.converted_folder(gguf)  # same bytes, same entry
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    assert models.converted_folder(damaged) != models.converted_folder(gguf)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        models.load_policy(str(damaged))
    assert not (cache / "gguf-hf").exists() or not any((cache / "gguf-hf").iterdir())


@pytest.mark.parametrize("damage", ["truncated weights", "no tokenizer"])
def test_a_damaged_cache_entry_is_converted_again(tiny_gguf_factory, cache, damage):
    gguf = tiny_gguf_factory("f16")
    want = {k: v.clone() for k, v in models.load_policy(str(gguf))[0].state_dict().items()}  # off the file's mmap
    folder = models.converted_folder(gguf)
    if damage == "truncated weights":  # a new, short file (truncating in place would pull the mapped pages away)
        weights = folder / "model.safetensors"
        head = weights.read_bytes()[:1000]
        weights.unlink()
        weights.write_bytes(head)
    else:
        (folder / "tokenizer.json").unlink()
    model, tokenizer = models.load_policy(str(gguf))
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want) and tokenizer("3 + 4").input_ids
    assert (folder / "tokenizer.json").is_file() and (folder / "model.safetensors").stat().st_size > 10_000
