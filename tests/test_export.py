"""jax.export of programs that call jzyfa: serialized, reloaded (also in a fresh process) and run on CPU.

One artifact serves CPU and CUDA: its CPU branch is the reference, its CUDA branch the kernel's FFI
custom call. Exporting that call is an explicit choice (the FFI target has no JAX compatibility
guarantee), made with `DisabledSafetyCheck.custom_call`; docs/jax_integration.md says more.
"""

import functools
import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

import jzyfa
from jzyfa.primitives import FFI_TARGET

pytestmark = pytest.mark.usefixtures("cpu_backend")

REPO = pathlib.Path(__file__).parent.parent
CHECKS = jzyfa.export_safety_checks()


@pytest.fixture(scope="module")
def prefill():
    spec = importlib.util.spec_from_file_location("prefill_for_export", REPO / "examples" / "prefill.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_prefill(prefill):
    """(jitted prefill, params, tokens) of a one-layer GQA transformer, on a CPU device."""
    cfg = prefill.Config(
        batch=2, seq=32, layers=1, d_model=64, heads_q=4, heads_kv=2, head_dim=64, mlp=128, vocab=64
    )
    cpu = jax.devices("cpu")[0]
    params = jax.device_put(prefill.init_params(cfg, jax.random.key(0)), cpu)
    tokens = jax.device_put(jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq), 0, cfg.vocab), cpu)
    attention = functools.partial(jzyfa.flash_attention, causal=True)
    return jax.jit(functools.partial(prefill.forward, cfg=cfg, attention=attention)), params, tokens


def test_serialized_prefill_reloads_and_runs(tiny_prefill):
    fn, params, tokens = tiny_prefill
    exported = jax.export.export(fn, platforms=("cpu", "cuda"), disabled_checks=CHECKS)(params, tokens)
    assert f"stablehlo.custom_call @{FFI_TARGET}" in exported.mlir_module()  # the CUDA branch
    reloaded = jax.export.deserialize(exported.serialize())
    assert reloaded.platforms == ("cpu", "cuda")
    np.testing.assert_array_equal(reloaded.call(params, tokens), fn(params, tokens))


def test_export_refuses_the_custom_call_unless_allowed(tiny_prefill):
    fn, params, tokens = tiny_prefill
    with pytest.raises(
        ValueError, match=f"(?s)custom calls whose targets have no compatibility guarantees.*{FFI_TARGET}"
    ):
        jax.export.export(fn, platforms=("cpu", "cuda"))(params, tokens)


def test_reloads_in_a_fresh_process(tiny_prefill, tmp_path):
    fn, params, tokens = tiny_prefill
    exported = jax.export.export(fn, platforms=("cpu", "cuda"), disabled_checks=CHECKS)(params, tokens)
    (tmp_path / "prefill.jax").write_bytes(exported.serialize())
    np.save(tmp_path / "want.npy", np.asarray(fn(params, tokens)))
    flat, _ = jax.tree.flatten((params, tokens))
    np.savez(tmp_path / "args.npz", *[np.asarray(x, np.float32) for x in flat])  # .npz has no bfloat16
    program = """
import sys, jax, numpy as np
import jzyfa
jzyfa.extension_loaded()  # registers the CUDA FFI targets where the extension is built; harmless elsewhere
exported = jax.export.deserialize(open(sys.argv[1] + "/prefill.jax", "rb").read())
args = np.load(sys.argv[1] + "/args.npz")
flat = [args[f"arr_{i}"].astype(aval.dtype) for i, aval in enumerate(exported.in_avals)]
got = exported.call(*jax.tree.unflatten(exported.in_tree, flat)[0])
np.testing.assert_array_equal(got, np.load(sys.argv[1] + "/want.npy"))
print("reloaded ok")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reloaded ok" in run.stdout


def test_sharded_program_exports_through_shard_map():
    """Batch/head-sharded attention inside shard_map: the kernel call is in the artifact per shard."""
    mesh = cpu_mesh((2, 2), ("data", "tensor"))
    spec = P("data", None, "tensor")
    attention = jax.shard_map(
        functools.partial(jzyfa.flash_attention, causal=True), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
    )
    fn = jax.jit(attention)
    rng = np.random.default_rng(0)
    sharding = NamedSharding(mesh, spec)
    q = jax.device_put(jnp.asarray(rng.standard_normal((2, 16, 4, 64)), jnp.bfloat16), sharding)
    kv = jax.device_put(jnp.asarray(rng.standard_normal((2, 16, 2, 64)), jnp.bfloat16), sharding)
    exported = jax.export.export(fn, platforms=("cpu", "cuda"), disabled_checks=CHECKS)(q, kv, kv)
    assert exported.nr_devices == 4 and FFI_TARGET in exported.mlir_module()
    out = jax.export.deserialize(exported.serialize()).call(q, kv, kv)
    assert out.sharding.is_equivalent_to(sharding, 4)
    np.testing.assert_array_equal(out, fn(q, kv, kv))


def test_export_safety_checks_cover_every_ffi_target():
    from jzyfa.primitives import FFI_TARGET_BWD, FFI_TARGET_VALUE_OPERAND

    want = {
        jax.export.DisabledSafetyCheck.custom_call(t)
        for t in (FFI_TARGET, FFI_TARGET_BWD, FFI_TARGET_VALUE_OPERAND)
    }
    assert set(jzyfa.export_safety_checks()) == want


@pytest.mark.parametrize("platforms", [("cpu",), ("cuda",), ("cpu", "cuda")])
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_symbolic_batch_and_sequence(platforms, window):
    """Symbolic b and s: the plan's launch limits are undecidable at export time and take the kernel
    path; the CPU branch serializes, reloads and runs at two concrete sizes."""
    fn = jax.jit(lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, window=window))
    specs = jax.export.symbolic_args_specs(
        [jax.ShapeDtypeStruct((1, 1, 8, 128), jnp.bfloat16)] * 3, "b, s, 8, 128"
    )
    exported = jax.export.export(fn, platforms=platforms, disabled_checks=jzyfa.export_safety_checks())(
        *specs
    )
    assert FFI_TARGET in exported.mlir_module()
    if "cpu" not in platforms:
        return
    reloaded = jax.export.deserialize(exported.serialize())
    rng = np.random.default_rng(0)
    for b, s in ((2, 24), (3, 40)):
        q, k, v = (jnp.asarray(rng.standard_normal((b, s, 8, 128)), jnp.bfloat16) for _ in range(3))
        got = reloaded.call(q, k, v)
        want = jzyfa.attention_reference(q, k, v, causal=True, window=window)[0]
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_symbolic_export_gradient():
    fn = jax.jit(
        jax.grad(lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32).sum())
    )
    specs = jax.export.symbolic_args_specs(
        [jax.ShapeDtypeStruct((1, 1, 4, 64), jnp.bfloat16)] * 3, "b, s, 4, 64"
    )
    exported = jax.export.export(fn, platforms=("cpu", "cuda"), disabled_checks=jzyfa.export_safety_checks())(
        *specs
    )
    reloaded = jax.export.deserialize(exported.serialize())
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 20, 4, 64)), jnp.bfloat16) for _ in range(3))
    want = jax.grad(lambda q: jzyfa.attention_reference(q, k, v, causal=True)[0].astype(jnp.float32).sum())(q)
    got = reloaded.call(q, k, v)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5e-2, rtol=5e-2
    )
