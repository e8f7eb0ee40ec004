"""`nearpolicy export` on a real 2-step run of the tiny model (started from its GGUF, as the default model is): the
HF folder loads with transformers and gives the trainer's log-probs; the GGUFs load in llama.cpp and give them
within their precision's bound; the chat template and end-of-generation set survive; the CLI's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nearpolicy.cli import main
from nearpolicy.config.schema import load_config
from nearpolicy.engines.llamacpp import LlamaCppEngine
from nearpolicy.runs.export import export_run
from nearpolicy.model.load import chat_prompt_ids, load_policy
from nearpolicy.types import SamplingParams

pytestmark = pytest.mark.slow

# (prompt, completion) token sequences scored teacher-forced
SEQUENCES = [([1, 504, 3287, 28, 1085, 6001], [30, 2683, 359, 253, 5356, 2]), ([1, 2683, 359], [253, 9690, 198, 314])]
# max |delta log p| (nats) against the trainer, measured on this run: HF folder 0 (the same float32 weights), f32
# GGUF with an f32 KV cache 5e-7 (test_engines.py's bound), f16 GGUF 2e-3 (weights rounded to f16, f16 dot products);
# the initial weights are 2.5 away, so each bound tells the trained weights from the initial ones
HF_BOUND, F32_BOUND, F16_BOUND = 1e-5, 5e-5, 0.02


@pytest.fixture(scope="module")
def trained(tiny_gguf_factory, tmp_path_factory):
    """(run folder, the trainer's final model and tokenizer, the initial model): 2 steps from the tiny f32 GGUF on the
    hf engine; the tiny model earns no reward, so AdamW's decoupled weight decay (lr x decay = 0.1 a step) is what
    moves the weights, well beyond every bound below. The last checkpoint is weights-only."""
    from nearpolicy.training.trainer import open_trainer

    out = tmp_path_factory.mktemp("runs")
    gguf_path = tiny_gguf_factory("f32")
    cfg = load_config(None, [f"model.path='{gguf_path}'", f"run.output_dir='{out}'", "run.name=x", "run.steps=2",
                             "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                             "algorithm.micro_batch_size=2", "algorithm.lr=0.05", "algorithm.weight_decay=2",
                             "sampling.max_new_tokens=6", "task.eval_size=2", "task.train_size=50",
                             "logging.eval_every=100", "logging.checkpoint_every=1", "logging.final_weights_only=true",
                             "logging.tensorboard=false", "logging.progress=false", "model.max_context=256",
                             "engine.kind=hf"])
    trainer = open_trainer(cfg, log=lambda _: None)
    trainer.fit(progress=False)
    initial = load_policy(str(gguf_path))[0].eval()
    return trainer.run_dir, trainer.s.model.eval(), trainer.s.tokenizer, initial


def _logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """Teacher-forced log p(completion_t | prefix) [T] float64, nats, of a transformers model."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy()


def _max_diff(score, model) -> float:
    return max(np.abs(np.asarray(score(p, c)) - _logprobs(model, p, c)).max() for p, c in SEQUENCES)


def test_export_gives_an_hf_folder_and_ggufs_with_the_trainers_logprobs(trained, tiny_gguf_factory, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, model, tokenizer, initial = trained
    done = export_run(run, ggufs=("f32", "f16"), log=lambda _: None)
    assert done.folder == run / "export" / "step_000002" and done.step == 2
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "policy-f32.gguf",
            "policy-f16.gguf"} <= {p.name for p in done.folder.iterdir()}
    assert [p.name for p in done.folder.parent.iterdir()] == ["step_000002"]  # no temporary folder left

    hf = AutoModelForCausalLM.from_pretrained(str(done.folder)).eval()
    assert hf.dtype == torch.float32
    assert _max_diff(lambda p, c: _logprobs(hf, p, c), model) < HF_BOUND
    assert _max_diff(lambda p, c: _logprobs(initial, p, c), model) > 0.5  # the run moved the weights: bounds can fail
    loaded = AutoTokenizer.from_pretrained(str(done.folder))
    question = "What is 3 + 4?"
    assert chat_prompt_ids(loaded, "Be brief.", question) == chat_prompt_ids(tokenizer, "Be brief.", question)
    assert hf.generation_config.eos_token_id == [2, 0, 4]  # the model's eos first, then the run's stop ids {0, 2, 4}

    sampling = SamplingParams(1.0, 1.0, 0, 8)
    for precision, bound in (("f32", F32_BOUND), ("f16", F16_BOUND)):
        engine = LlamaCppEngine(done.folder / f"policy-{precision}.gguf", max_context=64, max_parallel_sequences=1,
                                threads=1, kv_cache="f32")
        try:
            assert _max_diff(lambda p, c: engine.score(p, c, sampling), model) < bound, precision
        finally:
            engine.close()
    template = gguf.GGUFReader(str(tiny_gguf_factory("f32")))
    written = gguf.GGUFReader(str(done.folder / "policy-f16.gguf"))
    for key in ("tokenizer.chat_template", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"):
        assert written.fields[key].contents() == template.fields[key].contents(), key
    assert written.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)


def test_export_cli_refusals_and_forced_replacement(trained, tmp_path, capsys, monkeypatch):
    run = trained[0]
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # "." and ".." below: folders that hold neither the run nor its model
    model_file = Path(json.loads((run / "config.json").read_text())["model"]["path"])
    (tmp_path / "empty-run").mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    for args, needle in [([str(tmp_path / "nope")], "no run folder"),
                         ([str(tmp_path / "empty-run")], "has no checkpoint"),
                         ([str(run), "--step", "7"], "no checkpoint of step 7; steps with one: 1, 2"),
                         ([str(run), "--out", str(taken)], "exists and is not empty; pass --force"),
                         ([str(run), "--out", str(run), "--force"], "would hold or replace the run's checkpoints"),
                         ([str(run), "--out", ".", "--force"], "holds the current folder"),
                         ([str(run), "--out", "..", "--force"], "holds the current folder"),
                         ([str(run), "--out", str(model_file.parent), "--force"],
                          "would hold or replace the run's model.path")]:
        assert main(["export", *args]) == 2, args
        assert needle in capsys.readouterr().err, args
    with pytest.raises(SystemExit) as bad:
        main(["export", str(run), "--gguf", "q3_k"])
    assert bad.value.code == 2 and "invalid choice: 'q3_k'" in capsys.readouterr().err
    assert (taken / "mine.txt").read_text() == "keep me" and (run / "checkpoints" / "step_000002").is_dir()

    assert main(["export", str(run), "--step", "1", "--out", str(taken), "--force", "--gguf"]) == 0
    said = capsys.readouterr().err
    assert "from_pretrained" in said and "no GGUF written (--gguf with no precision)" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "empty-run", "taken"]  # nothing temporary left
    files = {p.name for p in taken.iterdir()}
    assert "model.safetensors" in files and "mine.txt" not in files and not any(f.endswith(".gguf") for f in files)
