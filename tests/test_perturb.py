"""Image perturbations: determinism, statistics, edge cells, structure of batches, errors."""

import random

import numpy as np
import pytest
from PIL import Image

from trl_mdi.tprl import perturb as P


def _random_image(w=64, h=48, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(1, 256, (h, w, 3), dtype=np.uint8)).convert(mode)


def _white(w, h):
    return Image.new("RGB", (w, h), (255, 255, 255))


def _black_fraction(img):
    return float((np.asarray(img).max(axis=2) == 0).mean())


def test_same_seed_step_index_gives_identical_images_independent_of_batch_and_global_rng():
    imgs = [_random_image(seed=i) for i in range(3)]
    np.random.seed(1), random.seed(1)
    a = P.perturb_images(imgs, seed=7, step=11)
    np.random.seed(2), random.seed(2)
    state = np.random.get_state()[1].copy()
    b = P.perturb_images(imgs, seed=7, step=11)
    assert np.array_equal(np.random.get_state()[1], state)  # global RNG untouched
    assert [x.tobytes() for x in a] == [x.tobytes() for x in b]
    # Row 2 alone, with its global index, matches row 2 of the batch (e.g. on another process, or resumed).
    alone = P.perturb_images([imgs[2]], seed=7, step=11, row_offset=2)[0]
    assert alone.tobytes() == a[2].tobytes()


def test_different_step_seed_or_row_give_different_masks():
    img = _white(140, 140)  # 100 cells: two independent masks coincide with probability 2^-100
    base = P.perturb_images([img, img], seed=0, step=0)
    assert base[0].tobytes() != base[1].tobytes()  # same image, different rows
    assert P.perturb_images([img], seed=0, step=1)[0].tobytes() != base[0].tobytes()
    assert P.perturb_images([img], seed=1, step=0)[0].tobytes() != base[0].tobytes()
    assert P.perturb_images([img], seed=0, step=0, row_offset=1)[0].tobytes() == base[1].tobytes()


@pytest.mark.parametrize("prob", [0.2, 0.5, 0.9])
def test_blackened_fraction_matches_prob_on_a_large_image(prob):
    out = P.perturb_image(_white(1400, 1400), prob=prob, generator=3)  # 100 x 100 = 10,000 cells
    cells = np.asarray(out)[:, :, 0].reshape(100, 14, 100, 14).transpose(0, 2, 1, 3).reshape(100, 100, -1)
    # Every cell is either entirely black or entirely untouched.
    assert np.all((cells.min(-1) == cells.max(-1)) & np.isin(cells.max(-1), [0, 255]))
    frac = (cells.max(-1) == 0).mean()
    assert abs(frac - prob) < 0.025  # binomial std <= 0.005: 5 sigma
    assert _black_fraction(out) == pytest.approx(frac)


def test_blackening_only_zeroes_pixels_and_keeps_the_rest_exactly():
    img = _random_image(70, 42)  # no zero pixel in the source
    out = np.asarray(P.perturb_image(img, generator=0))
    src = np.asarray(img)
    black = (out == 0).all(axis=2)
    assert 0 < black.mean() < 1
    assert np.array_equal(out[~black], src[~black])


def test_edge_cells_are_partial_and_blacked_whole():
    # 30 x 17 px with 14 px cells: columns [0,14) [14,28) [28,30), rows [0,14) [14,17): 3 x 2 cells.
    w, h, ps = 30, 17, 14
    mask = P.patch_blackening_mask(h, w, ps, 1.0, np.random.default_rng(0))
    assert mask.shape == (h, w) and mask.all()
    edge_seen = 0
    for seed in range(40):
        out = np.asarray(P.perturb_image(_white(w, h), patch_size=ps, generator=seed))[:, :, 0]
        for r0, r1 in ((0, 14), (14, 17)):
            for c0, c1 in ((0, 14), (14, 28), (28, 30)):
                cell = out[r0:r1, c0:c1]
                assert cell.min() == cell.max()  # a cell, partial or not, is all black or all white
                edge_seen += (c0 == 28 or r0 == 14) and cell.max() == 0
    assert edge_seen > 0  # partial edge cells do get blacked
    assert P.perturb_image(_white(w, h), patch_size=ps, prob=1.0, generator=0).getextrema() == ((0, 0),) * 3


@pytest.mark.parametrize(
    "kind,params",
    [
        ("patch_blackening", {}),
        ("gaussian_noise", {}),
        ("gaussian_noise", {"noise_std": 5.0}),
        ("blur", {}),
        ("blur", {"blur_radius": 1.0}),
        ("black", {}),
    ],
)
def test_each_kind_changes_the_image_and_preserves_size_and_mode(kind, params):
    img = _random_image(50, 33)
    before = img.tobytes()
    out = P.perturb_image(img, kind, generator=0, **params)
    assert out.size == img.size and out.mode == "RGB"
    assert out.tobytes() != before
    assert img.tobytes() == before  # input untouched


def test_identity_settings_leave_the_image_unchanged():
    img = _random_image(50, 33)
    assert P.perturb_image(img, prob=0.0, generator=0).tobytes() == img.tobytes()
    assert P.perturb_image(img, "gaussian_noise", noise_std=0.0, generator=0).tobytes() == img.tobytes()


def test_gaussian_noise_statistics():
    gray = Image.new("RGB", (200, 200), (128, 128, 128))
    out = np.asarray(P.perturb_image(gray, "gaussian_noise", noise_std=10.0, generator=0)).astype(float) - 128
    assert abs(out.mean()) < 0.2 and out.std() == pytest.approx(10.0, rel=0.03)
    clipped = np.asarray(P.perturb_image(gray, "gaussian_noise", generator=0))  # VPPO's std 189
    assert clipped.min() == 0 and clipped.max() == 255


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_non_rgb_input_gives_rgb_output_of_same_size(mode):
    img = _random_image(31, 19, mode=mode)
    for kind in P.PERTURBATIONS:
        out = P.perturb_image(img, kind, generator=0)
        assert out.mode == "RGB" and out.size == (31, 19), kind


def test_nested_rows_keep_their_structure():
    a, b, c = _random_image(28, 28, 1), _random_image(42, 14, 2), _random_image(20, 30, 3)
    out = P.perturb_images([a, None, [], [b, c], (a,)], "patch_blackening", seed=0, step=5)
    assert out[1] is None and out[2] == []
    assert isinstance(out[3], list) and [x.size for x in out[3]] == [(42, 14), (20, 30)]
    assert isinstance(out[4], list) and len(out[4]) == 1
    # A bare image and a one-image row at the same row index draw the same mask.
    assert P.perturb_images([[a]], seed=0, step=5)[0][0].tobytes() == out[0].tobytes()
    # Two images in one row draw different masks (image index is part of the key).
    twice = P.perturb_images([[a, a]], seed=0, step=5)[0]
    assert twice[0].tobytes() != twice[1].tobytes()
    assert P.perturb_images([], seed=0, step=0) == []


def test_errors_name_the_parameter():
    img = _white(20, 20)
    with pytest.raises(
        ValueError,
        match="unknown perturbation kind 'mask'; valid kinds: patch_blackening, gaussian_noise, blur, black",
    ):
        P.perturb_image(img, "mask")
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"prob must be in \[0, 1\]"):
            P.perturb_image(img, prob=bad)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="patch_size must be an integer >= 1"):
            P.perturb_image(img, patch_size=bad)
    with pytest.raises(ValueError, match="noise_std must be finite and >= 0"):
        P.perturb_image(img, "gaussian_noise", noise_std=-1.0)
    with pytest.raises(ValueError, match="blur_radius must be finite and >= 0"):
        P.perturb_image(img, "blur", blur_radius=-1.0)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        P.perturb_images([None], seed=0, step=-1)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        P.perturb_images([img], seed=1.5, step=0)
    with pytest.raises(ValueError, match="unknown perturbation kind"):
        P.perturb_images([img], "noise", seed=0, step=0)
    with pytest.raises(TypeError, match="PIL"):
        P.perturb_images(["path/to/img.png"], seed=0, step=0)


def test_grey_is_uniform_mid_grey_of_the_same_size_whatever_the_input():
    # Nothing of the real image leaks: two different images (and modes) give byte-identical grey images.
    a, b = _random_image(37, 21, seed=1), _random_image(37, 21, seed=2, mode="RGBA")
    ga, gb = P.perturb_image(a, "grey"), P.perturb_image(b, "grey", generator=5)
    assert ga.size == (37, 21) and ga.mode == "RGB" and ga.tobytes() == gb.tobytes()
    assert ga.getextrema() == ((128, 128),) * 3 and P.GREY == (128, 128, 128)
    rows = P.perturb_images([a, None, [b, a]], "grey", seed=0, step=0)
    assert rows[1] is None and [r.size for r in rows[2]] == [(37, 21), (37, 21)]
    assert rows[0].tobytes() == rows[2][1].tobytes() == P.perturb_images([a], "grey", seed=9, step=4)[0].tobytes()
    assert a.tobytes() == _random_image(37, 21, seed=1).tobytes()  # input untouched


def test_existing_kinds_are_unchanged_by_the_grey_kind():
    # Digests of the seeded kinds' outputs, recorded before "grey" was added: adding a kind must not move
    # their draws. (Blur is left out: its pixels depend on PIL's kernel, not on us.)
    import hashlib

    img = _random_image(30, 20, seed=4)
    digests = {k: hashlib.sha256(P.perturb_images([img], k, seed=3, step=2)[0].tobytes()).hexdigest()[:16]
               for k in EXPECTED_DIGESTS}
    assert digests == EXPECTED_DIGESTS


EXPECTED_DIGESTS = {"patch_blackening": "bef9eab51d64d9d0", "gaussian_noise": "af0fd0675836cd2b",
                    "black": "09cec5a5bd8afffb"}
