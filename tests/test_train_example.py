"""examples/train.py trains its byte-level LM on a CPU (loss falls, runs repeat exactly, jzyfa's attention
trains like jax.nn's XLA attention), its checkpoints load back to the same logits, and
examples/capture.py writes the q, k, v its loader reads back. CPU, small sizes: the jitted steps compile
once per attention and are reused by every test (module-level jits with the configs static)."""

import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import capture
import lm
import prefill
import stdlib_text
import train

# The cpu preset's model at a shorter sequence, for a few steps; log_every beyond the steps keeps the
# output to the first and last step.
FLAGS = ["--preset", "cpu", "--seq", "64", "--steps", "8", "--eval-batches", "1", "--log-every", "100"]


@pytest.fixture(scope="module")
def corpus():
    return stdlib_text.load_corpus()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """train.py --compare xla --save: both runs, and the checkpoint of the jzyfa one."""
    checkpoint = tmp_path_factory.mktemp("train") / "lm.npz"
    result = train.main(FLAGS + ["--compare", "xla", "--save", str(checkpoint)])
    return result, checkpoint


def test_corpus_is_the_stdlib_split_by_file(corpus):
    assert corpus.train_files > 10 * corpus.held_out_files > 0
    assert len(corpus.held_out) > 100_000
    # The held-out split is whole files, chosen by path: no held-out file's text starts a training one.
    first_held_out = corpus.held_out[: corpus.held_out.tobytes().index(stdlib_text.DOCUMENT_SEPARATOR)]
    assert first_held_out.tobytes() not in corpus.train.tobytes()


def test_loss_falls(cli_run):
    result, _ = cli_run
    jzyfa_run = result["runs"][0]
    losses = jzyfa_run["losses"]
    assert jzyfa_run["attention"] == "jzyfa" and len(losses) == 8
    assert losses[0] == pytest.approx(math.log(256), abs=1.0)  # about uniform over the bytes at first
    assert losses[-1] < losses[0] - 1.0
    assert jzyfa_run["held_out_loss"] < losses[0] - 1.0
    assert jzyfa_run["held_out_bits_per_byte"] == pytest.approx(jzyfa_run["held_out_loss"] / math.log(2))
    assert jzyfa_run["tokens_per_second"] > 0


def test_same_seed_same_run_other_seed_other_run(cli_run, corpus):
    result, _ = cli_run
    config, train_cfg, first = result["config"], result["train"], result["runs"][0]
    again = train.train(config, train_cfg, corpus, seed=0, log=lambda _: None)
    assert again["losses"] == first["losses"]
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(again["params"]), jax.tree.leaves(first["params"]))
    )
    other = train.train(config, train_cfg, corpus, seed=1, log=lambda _: None)
    assert other["losses"][0] != first["losses"][0]


def test_jzyfa_attention_trains_like_xla_attention(cli_run, capsys):
    result, _ = cli_run
    jzyfa_run, xla_run = result["runs"]
    assert xla_run["attention"] == "xla"
    # bf16 attention rounded in two orders: the curves part by a few 1e-4 nats over 8 steps.
    assert abs(jzyfa_run["losses"][0] - xla_run["losses"][0]) < 2e-3
    assert result["max_loss_difference"] == max(
        abs(a - b) for a, b in zip(jzyfa_run["losses"], xla_run["losses"])
    )
    assert result["max_loss_difference"] < 1e-2
    assert abs(jzyfa_run["held_out_loss"] - xla_run["held_out_loss"]) < 1e-2


def test_checkpoint_loads_back_to_the_same_logits(cli_run, corpus):
    result, checkpoint = cli_run
    config, params = lm.load_checkpoint(checkpoint)
    assert config == result["config"]
    trained = result["runs"][0]["params"]
    assert jax.tree.structure(params) == jax.tree.structure(trained)
    tokens = jnp.asarray(corpus.held_out[None, :64], jnp.int32)
    apply = jax.jit(lm.apply, static_argnums=(0, 3))
    np.testing.assert_array_equal(
        apply(config, params, tokens, "jzyfa"), apply(config, trained, tokens, "jzyfa")
    )


def test_loaded_checkpoint_evaluates_as_it_was_saved(cli_run):
    result, checkpoint = cli_run
    loaded = train.main(FLAGS + ["--load", str(checkpoint), "--steps", "0"])
    assert loaded["config"] == result["config"] and loaded["runs"][0]["losses"] == []
    assert loaded["runs"][0]["held_out_loss"] == result["runs"][0]["held_out_loss"]


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention must be one of"):
        lm.attention_fn("flash")


def test_capture_writes_what_its_loader_reads(cli_run, tmp_path, capsys):
    _, checkpoint = cli_run
    out = tmp_path / "qkv.npz"
    header = capture.main(["--checkpoint", str(checkpoint), "--seq", "96", "--out", str(out)])
    config, params = lm.load_checkpoint(checkpoint)
    assert header["layers"] == config.layers and header["seq"] == 96 and header["dtype"] == "bfloat16"
    captured = capture.load_captured(out)
    assert len(captured) == config.layers
    for q, k, v in captured:
        assert q.shape == (1, 96, config.heads_q, config.head_dim) and q.dtype == jnp.bfloat16
        assert k.shape == v.shape == (1, 96, config.heads_kv, config.head_dim)
        assert k.dtype == v.dtype == jnp.bfloat16
    # Layer 0's inputs of attention, computed here from the text and the weights, are what was written.
    tokens = stdlib_text.load_corpus().held_out[None, :96].astype(np.int32)
    bf16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    first_layer = jax.tree.map(lambda w: w[0], bf16["layers"])
    expected = jax.jit(prefill.project_qkv, static_argnums=2)(bf16["embed"][tokens], first_layer, config)
    for got, want in zip(captured[0], expected):
        np.testing.assert_array_equal(got.astype(np.float32), np.asarray(want, np.float32))
    # Deeper layers differ from the first: each layer's own inputs were captured.
    assert not np.array_equal(captured[0][0], captured[-1][0])
    assert "wrote q, k, v of 2 layers" in capsys.readouterr().out


def test_h200_preset_traces_at_its_full_size():
    """The GPU preset's step, traced on shapes only (nothing allocated): a preset that cannot run is
    found here, not on the GPU."""
    config, train_cfg = train.PRESETS["h200"]
    assert config.heads_q * config.head_dim == config.d_model and config.head_dim == 128
    assert config.heads_q % config.heads_kv == 0 and config.vocab == lm.VOCAB
    params = jax.eval_shape(lambda: lm.init_params(config, jax.random.key(0)))
    opt = jax.eval_shape(train.adamw_init, params)
    windows = jax.ShapeDtypeStruct((config.batch, config.seq + 1), jnp.uint8)
    step = jax.eval_shape(
        lambda p, o, w: train.train_step(p, o, w, config=config, train=train_cfg, attention="jzyfa"),
        params,
        opt,
        windows,
    )
    new_params, _, metrics = step
    assert jax.tree.map(lambda a: (a.shape, a.dtype), new_params) == jax.tree.map(
        lambda a: (a.shape, a.dtype), params
    )
    assert metrics["loss"].shape == () and metrics["loss"].dtype == jnp.float32
    assert 80e6 < sum(a.size for a in jax.tree.leaves(params)) < 100e6


def test_held_out_loss_uses_the_batches_the_held_out_bytes_fill(monkeypatch):
    """The h200 preset asks for 8 batches of 32 windows of 4097 bytes; Python 3.12's held-out files fill
    3: the loss averages the batches that fit instead of failing after training; not even one is an error."""
    config = train.parse_args(["--preset", "cpu", "--seq", "16", "--batch", "2"])[0]
    seen = []
    monkeypatch.setattr(
        train, "held_out_loss_step", lambda config, params, batch, attention: seen.append(batch) or 1.0
    )
    held_out = np.arange(3 * 2 * 17 + 5, dtype=np.uint8)
    assert train.held_out_loss(config, {}, held_out, 8, "xla") == 1.0
    assert len(seen) == 3 and all(batch.shape == (2, 17) for batch in seen)
    with pytest.raises(ValueError, match="2 windows of 17 bytes need 34 bytes; the data has 20"):
        train.held_out_loss(config, {}, held_out[:20], 8, "xla")  # not even one batch
