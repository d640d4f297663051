"""Issue 31: the built-in targets are trained models whose weights ship in the package.

The shipped files are the ones pipelines/train_builtin.py recorded (sha256), a damaged one is
refused in one line, the HF directory `save_builtin` writes loads back to the same model (MTP head
included), and a prefix of the training re-run here gives the recorded losses.
"""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from hscache.capture import BUILTIN_TARGETS
from hscache.capture.builtin import (
    RECORD_FILE,
    TOKENIZER_FILE,
    build_builtin,
    build_tokenizer,
    builtin_mtp_weights,
    data_dir,
    load_builtin_weights,
    save_builtin,
    training_record,
    weights_file,
)
from hscache.errors import ModelNotFoundError


def test_shipped_weights_are_the_recorded_ones_and_small():
    record, root = training_record(), data_dir()
    total = 0
    for name in BUILTIN_TARGETS:
        blob = (root / weights_file(name)).read_bytes()
        total += len(blob)
        assert hashlib.sha256(blob).hexdigest() == record["targets"][name]["sha256"], name
        assert len(record["targets"][name]["losses"]) == record["settings"]["steps"][name]
        # Trained: the last 50 steps' mean loss is far below the first step's (ln 320 = 5.77).
        losses = [step[0] for step in record["targets"][name]["losses"]]
        assert sum(losses[-50:]) / 50 < losses[0] - 1.5, name
    tok = (root / TOKENIZER_FILE).read_bytes()
    assert hashlib.sha256(tok).hexdigest() == record["tokenizer_sha256"]
    assert total <= 10 * 2**20  # the budget for both
    assert len(build_tokenizer()) == record["settings"]["vocab_size"]


def test_built_targets_hold_the_shipped_weights():
    for name in BUILTIN_TARGETS:
        model, _ = build_builtin(name)
        shipped = load_builtin_weights(name)
        state = model.state_dict()
        for key, value in shipped.items():
            if not key.startswith("mtp."):
                assert torch.equal(state[key], value), key
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert next(model.parameters()).dtype == torch.float32
    mtp = builtin_mtp_weights(build_builtin("builtin:tiny-qwen3.5")[0].config)
    assert "mtp.fc.weight" in mtp and mtp["mtp.fc.weight"].shape == (128, 256)


def test_the_meta_device_build_equals_a_cpu_initialised_one_bit_for_bit():
    """build_builtin skips the random initialisation (meta device, the file's tensors assigned, the
    rotary tables rebuilt): every parameter and buffer, the logits and a greedy continuation equal a
    target built on the CPU and then loaded, no tensor is left on the meta device, and the build does
    not move the caller's RNG."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    from hscache.capture.builtin import builtin_config

    classes = {"builtin:tiny-qwen3.5": Qwen3_5ForCausalLM, "builtin:tiny-qwen3": Qwen3ForCausalLM}
    for name in BUILTIN_TARGETS:
        before = torch.random.get_rng_state()
        fast, tok = build_builtin(name)
        assert torch.equal(torch.random.get_rng_state(), before)
        slow = classes[name](builtin_config(name, vocab_size=len(tok), eos_id=tok.eos_token_id))
        weights = {k: v for k, v in load_builtin_weights(name).items() if not k.startswith("mtp.")}
        slow.load_state_dict(weights, strict=False)
        slow.tie_weights()
        slow.eval()
        a = {**dict(fast.named_parameters()), **dict(fast.named_buffers())}
        b = {**dict(slow.named_parameters()), **dict(slow.named_buffers())}
        assert a.keys() == b.keys() and any("rotary_emb" in k for k in a)
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        assert not [
            (m, k) for m, module in fast.named_modules() for k, v in vars(module).items()
            if isinstance(v, torch.Tensor) and v.is_meta
        ]  # fmt: skip
        assert not fast.training and all(p.requires_grad for p in fast.parameters())
        ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n" * 2)])
        with torch.no_grad():
            assert torch.equal(fast(ids).logits, slow(ids).logits)
        greedy = dict(max_new_tokens=6, do_sample=False)
        assert torch.equal(fast.generate(ids, **greedy), slow.generate(ids, **greedy))


def test_a_damaged_weights_file_is_refused_in_one_line(tmp_path):
    root = tmp_path / "builtin"
    shutil.copytree(data_dir(), root)
    name = "builtin:tiny-qwen3"
    assert load_builtin_weights(name, root).keys() == load_builtin_weights(name).keys()
    path = root / weights_file(name)
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x01  # one bit of one weight: the file still parses
    path.write_bytes(bytes(blob))
    with pytest.raises(ModelNotFoundError) as err:
        load_builtin_weights(name, root)
    message = str(err.value)
    assert "\n" not in message and "sha256" in message and weights_file(name) in message
    (root / RECORD_FILE).unlink()
    with pytest.raises(ModelNotFoundError, match="training record"):
        load_builtin_weights(name, root)


def test_save_builtin_writes_a_directory_transformers_loads(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = "builtin:tiny-qwen3.5"
    directory = save_builtin(name, tmp_path / "t35")
    model, tokenizer = build_builtin(name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = tokenizer("def add(a, b):\n    return a + b\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert (
        AutoTokenizer.from_pretrained(directory)(["x = 1"])["input_ids"] == tokenizer(["x = 1"])["input_ids"]
    )
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        mtp = {k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    want = builtin_mtp_weights(model.config)
    assert mtp.keys() == want.keys() and all(torch.equal(mtp[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_prefix_of_the_training_reproduces_the_record():
    """Re-run the tokenizer training and the first steps of both targets: the tokenizer's sha256
    and the per-step losses are the recorded ones (same corpus, same torch)."""
    import sys

    from pipelines import train_builtin as tb

    record = training_record()
    docs = tb.corpus_documents()
    if tb.corpus_sha256(docs) != record["corpus"]["sha256"]:
        pytest.skip(
            f"the corpus differs from the recorded one (this interpreter's standard library is Python "
            f"{sys.version.split()[0]}, the record's {record['python']})"
        )
    if torch.__version__ != record["torch"]:
        pytest.skip(f"torch {torch.__version__} is not the recorded {record['torch']}")
    settings = record["settings"]
    tok_json = tb.train_tokenizer(docs, settings["vocab_size"])
    assert hashlib.sha256(tok_json.encode()).hexdigest() == record["tokenizer_sha256"]
    from hscache.capture.builtin import tokenizer_from_json

    tokenizer = tokenizer_from_json(tok_json)
    stream = tb.token_stream(docs, tokenizer)
    assert len(stream) == record["corpus"]["tokens"]
    threads = torch.get_num_threads()
    torch.set_num_threads(settings["threads"])
    try:
        for name in BUILTIN_TARGETS:
            _, losses = tb.train_target(name, stream, tokenizer, settings, steps=3)
            want = record["targets"][name]["losses"][:3]
            flat, want_flat = [x for step in losses for x in step], [x for step in want for x in step]
            assert len(flat) == len(want_flat) and flat == pytest.approx(want_flat, abs=1e-5), name
    finally:
        torch.set_num_threads(threads)
