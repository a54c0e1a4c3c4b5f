"""Pure metric functions on hand-made tensors."""

import math

import pytest
import torch

from trl_mdi.attention import metrics as M


def test_layer_segments_thirds_cover_all_layers_contiguously():
    for n in range(1, 40):
        seg = M.layer_segments(n)
        named = [i for name in ("early", "middle", "late") for i in seg.get(name, [])]
        assert named == list(range(n)), n
        sizes = [len(seg[k]) for k in ("early", "middle", "late") if k in seg]
        assert max(sizes) - min(sizes) <= 1
        assert seg["all"] == list(range(n))


def test_layer_segments_custom_and_errors():
    seg = M.layer_segments(12, "early:0-3,middle:4-7,late:-4--1")
    assert seg["early"] == [0, 1, 2, 3] and seg["late"] == [8, 9, 10, 11]
    assert M.layer_segments(4, {"x": [1, 2]})["x"] == [1, 2]
    with pytest.raises(ValueError, match="model has 4 layers"):
        M.layer_segments(4, "early:0-5")
    with pytest.raises(ValueError, match="expected 'name:first-last'"):
        M.layer_segments(4, "early=0-2")
    with pytest.raises(ValueError, match="reserved"):
        M.layer_segments(4, "all:0-1")
    with pytest.raises(ValueError, match="is empty"):
        M.layer_segments(4, "x:3-1")


def test_mdi_definition_and_undefined_rows():
    text = torch.tensor([0.6, 0.3, 0.5, 0.5])
    image = torch.tensor([0.2, 0.6, 0.0, 0.5])
    n_t = torch.tensor([30, 10, 10, 10])
    n_o = torch.tensor([10, 10, 10, 0])
    out = M.mdi(text, image, n_t, n_o)
    assert out[0].item() == pytest.approx((0.6 / 30) / (0.2 / 10))
    assert out[1].item() == pytest.approx(0.5)
    assert math.isinf(out[2].item())  # image tokens exist but get no attention: text fully dominant
    assert math.isnan(out[3].item())  # no image tokens: undefined, never 1.0


def test_aei_ratio_equals_mdi():
    g = torch.Generator().manual_seed(0)
    text, image = torch.rand(50, generator=g), torch.rand(50, generator=g)
    n_t, n_o = torch.randint(1, 100, (50,), generator=g), torch.randint(1, 100, (50,), generator=g)
    aei_t, aei_o = M.aei(text, image, n_t, n_o)
    torch.testing.assert_close(aei_t / aei_o, M.mdi(text, image, n_t, n_o), rtol=1e-5, atol=0)
    # Attention proportional to token count gives AEI 1 for both modalities.
    t, o = M.aei(torch.tensor([0.3]), torch.tensor([0.1]), torch.tensor([3]), torch.tensor([1]))
    assert t.item() == pytest.approx(1.0) and o.item() == pytest.approx(1.0)


def test_mdi_balance_formula_and_bounds():
    mdi = torch.tensor([1.0, 2.0, 0.5, 1.5, 1 / 1.5, 10.0, float("nan")])
    bal = M.mdi_balance(mdi, 2.0)
    expected = [1.0, 0.0, 0.0, 1 - math.log(1.5) / math.log(2), 1 - math.log(1.5) / math.log(2), 0.0]
    torch.testing.assert_close(bal[:6], torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert math.isnan(bal[6].item())
    assert M.mdi_balance(torch.tensor([3.0]), 4.0).item() == pytest.approx(1 - math.log(3) / math.log(4))
    with pytest.raises(ValueError, match="> 1"):
        M.mdi_balance(mdi, 1.0)


def test_segment_metrics_average_masses_before_ratio():
    text = torch.tensor([[0.8, 0.2, 0.5]])
    image = torch.tensor([[0.1, 0.4, 0.25]])
    n_t, n_o = torch.tensor([10]), torch.tensor([10])
    out = M.segment_metrics(text, image, n_t, n_o, {"a": [0, 1], "all": [0, 1, 2]})
    assert out["a"]["mdi"].item() == pytest.approx(((0.8 + 0.2) / 2) / ((0.1 + 0.4) / 2))
    assert out["all"]["text_mass"].item() == pytest.approx(0.5)
