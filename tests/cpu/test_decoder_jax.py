"""The JAX decoder of examples/jax_decoder.py generates with kvcupy's PagedKVCache
as it does with JAX's own attention (tests/decoders.py: what is demanded)."""

import pytest

from ..decoders import DEVICES, KV_DTYPES, check_run, require_kvcupy_device

jax = pytest.importorskip("jax")

from examples import jax_decoder  # noqa: E402  (needs JAX)


def jax_has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:   # no GPU backend in this JAX
        return False


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_jax_decoder_matches_jax_attention(kv_dtype, device, record_property):
    require_kvcupy_device(device)
    if device == "cuda" and not jax_has_gpu():
        pytest.skip("JAX has no GPU backend here")
    check_run(jax_decoder.run, "JAX", kv_dtype, device, record_property)
