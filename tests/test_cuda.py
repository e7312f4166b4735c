"""CUDA against a float64 CPU reference: model, optimizers, delay + Error Feedback, checkpoints across devices.

Every test runs on ``cpu`` in the default test run (float32 and bf16 autocast against float64, so the
comparisons and their tolerances are exercised everywhere) and again on ``cuda`` where one is available,
skipped one by one without it. The checks and their tolerances live in ``bubblefree.bench.parity``, which
``bubblefree bench device`` runs on the accelerator too.
"""

import pytest
import torch

from bubblefree.bench.parity import (
    CHECKS,
    TOL,
    checkpoint_roundtrip,
    delayed_parity,
    model_parity,
    optimizer_parity,
    rel_err,
)
from bubblefree.optim import OPTIMIZERS

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


def _assert_ok(result):
    assert result["ok"], f"{result['check']} on {result['device']}: errors {result['errors']} " \
                         f"above tolerances {result['tolerances']}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_forward_backward_matches_float64(device, dtype):
    _assert_ok(model_parity(device, dtype=dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_moe_forward_backward_matches_float64(device):
    _assert_ok(model_parity(device, dtype="float32", preset="moe-1m"))


def test_bf16_autocast_is_really_bf16():
    """The bf16 check is not a float32 run in disguise: its errors are bf16-sized, far above float32's."""
    bf16, fp32 = model_parity("cpu", dtype="bfloat16"), model_parity("cpu", dtype="float32")
    assert bf16["errors"]["logits"] > 1e-3 > 100 * fp32["errors"]["logits"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compute_updates_match_float64(device, name):
    _assert_ok(optimizer_parity(device, name))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_newton_schulz_dtypes_match_float64(device, ns_dtype):
    result = optimizer_parity(device, "muon", ns_dtype=ns_dtype)
    _assert_ok(result)
    if ns_dtype == torch.bfloat16:  # bf16 really ran: its error is far above float32's
        assert result["errors"]["updates"] > 10 * TOL["update"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_delayed_optimizer_with_error_feedback_matches_float64(device, name):
    _assert_ok(delayed_parity(device, name, ns_dtype=torch.float32 if name == "muon" else None))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_saved_on_device_resumes_on_cpu_and_back(device, data_cache, tmp_path):
    result = checkpoint_roundtrip(device, "cpu", work=tmp_path)
    _assert_ok(result)
    assert set(result["errors"]) == {"resumed on b", "back on a"}


def test_rel_err_is_normwise():
    ref = torch.tensor([3.0, 4.0])
    assert rel_err(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx(0.1)
    assert rel_err(torch.ones(2), torch.zeros(2)) == pytest.approx(2 ** 0.5)  # absolute against zero


def test_every_check_is_named():
    assert len(CHECKS) == len(set(CHECKS)) and {f"optimizer {n}" for n in OPTIMIZERS} <= set(CHECKS)
