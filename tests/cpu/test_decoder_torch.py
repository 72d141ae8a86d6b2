"""The torch decoder of examples/torch_decoder.py generates with kvcupy's PagedKVCache
as it does with torch's own attention (tests/decoders.py: what is demanded)."""

import pytest

from ..decoders import DEVICES, KV_DTYPES, check_run, require_kvcupy_device

torch = pytest.importorskip("torch")

from examples import torch_decoder  # noqa: E402  (needs torch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_torch_decoder_matches_torch_attention(kv_dtype, device, record_property):
    require_kvcupy_device(device)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    check_run(torch_decoder.run, "torch", kv_dtype, device, record_property)
