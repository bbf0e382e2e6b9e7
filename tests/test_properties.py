"""Property-based tests (Hypothesis) over the two boundaries where outside data comes in: config values and image
files. Whatever comes in is either taken (with the right types and ranges) or refused with a ValueError naming it;
never another exception, never a wrong pixel type."""
import dataclasses
import io
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from vitkit import ViTConfig
from vitkit.data.images import BadImageError, open_image, to_array
from vitkit.training.config import TrainConfig

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-10**7, 10**7), st.floats(allow_nan=True),
                      st.text(max_size=8), st.sampled_from(["1e-3", "4", "four", "nan", "-1", "0", "2.5"]),
                      st.lists(st.integers(-3, 300), max_size=3), st.dictionaries(st.text(max_size=4),
                                                                                    st.integers(), max_size=2))


def _fields(cls):  # type: ignore[no-untyped-def]
    return [f.name for f in dataclasses.fields(cls)]


def _take_or_refuse(cls, d):  # type: ignore[no-untyped-def]
    """The config ``d`` makes, or None when it was refused with a message (any other exception fails the test)."""
    try:
        return cls.from_dict(d)
    except ValueError as e:
        assert str(e)  # a message, naming what was wrong
        return None


@FAST
@given(st.dictionaries(st.sampled_from(_fields(ViTConfig) + ["embed_size", "dpeth"]), ANY_VALUE, max_size=4))
def test_vit_config_takes_or_refuses_any_mapping(d):
    if (c := _take_or_refuse(ViTConfig, d)) is None:
        return
    assert 1 <= c.depth <= 1024 and 1 <= c.embed_dim <= 65536 and c.embed_dim % c.num_heads == 0
    assert isinstance(c.depth, int) and not isinstance(c.depth, bool)
    assert 0 < c.mlp_ratio <= 64 and math.isfinite(c.layer_norm_eps)
    for rate in (c.drop_rate, c.attn_drop_rate, c.proj_drop_rate, c.pos_drop_rate, c.drop_path_rate):
        assert 0 <= rate < 1
    assert ViTConfig.from_dict(c.to_dict()) == c  # what it took round-trips


@FAST
@given(st.dictionaries(st.sampled_from(_fields(TrainConfig) + ["epoch", "learning_rate"]), ANY_VALUE, max_size=4))
def test_train_config_takes_or_refuses_any_mapping(d):
    if (c := _take_or_refuse(TrainConfig, d)) is None:
        return
    assert c.epochs >= 1 and c.batch_size >= 1 and c.lr > 0 and math.isfinite(c.lr)
    assert c.time_limit is None or c.time_limit > 0
    assert all(isinstance(getattr(c, k), float) for k in ("lr", "min_lr", "weight_decay", "smoothing"))


@FAST
@given(st.sampled_from(["1e-3", "0.001", 1e-3, "1E-3"]))
def test_numbers_written_as_text_are_the_number_meant(lr):
    assert TrainConfig(lr=lr).lr == pytest.approx(1e-3)


MODES = ["1", "L", "I;16", "I", "F", "P", "LA", "RGB", "RGBA", "CMYK", "YCbCr"]
FORMAT = {"1": "PNG", "L": "PNG", "I;16": "PNG", "I": "TIFF", "F": "TIFF", "P": "PNG", "LA": "PNG", "RGB": "PNG",
          "RGBA": "PNG", "CMYK": "JPEG", "YCbCr": "JPEG"}


def _image(mode: str, h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode in ("I;16", "I"):
        return Image.fromarray(rng.integers(0, 65536, (h, w)).astype(np.uint16 if mode == "I;16" else np.int32))
    if mode == "F":
        return Image.fromarray(rng.random((h, w), dtype=np.float32), mode="F")
    bands = len(Image.new(mode, (1, 1)).getbands())
    a = rng.integers(0, 256, (h, w, bands) if bands > 1 else (h, w), dtype=np.uint8)
    base = Image.fromarray(a.reshape(h, w, bands)[..., :3] if bands >= 3 else a.reshape(h, w, bands)[..., 0])
    return base.convert(mode) if mode not in ("RGBA", "LA") else Image.fromarray(a, mode=mode)


@FAST
@given(st.sampled_from(MODES), st.integers(1, 24), st.integers(1, 24), st.integers(0, 2**16), st.sampled_from([1, 3]),
       st.sampled_from([None, (8, 8), (5, 12)]))
def test_every_image_mode_decodes_to_uint8_of_the_asked_shape(mode, h, w, seed, channels, size):
    img = _image(mode, h, w, seed)
    buf = io.BytesIO()
    img.save(buf, format=FORMAT[mode])
    decoded = open_image(buf.getvalue(), f"x.{FORMAT[mode].lower()}")
    a = to_array(decoded, channels, size)
    assert a.dtype == np.uint8 and a.shape == (channels, *(size or (h, w)))
    if size is None and channels == 1 and mode in ("I;16", "I"):
        src = np.asarray(img).astype(np.float64) / 257.0  # 16-bit levels scaled, never clipped
        np.testing.assert_allclose(a[0], np.clip(src, 0, 255), atol=0.51)
    if size is None and channels == 1 and mode == "F":
        np.testing.assert_allclose(a[0], np.asarray(img) * 255.0, atol=0.51)  # 0-1 floats span 0-255
    if size is None and (mode, channels) in (("L", 1), ("RGB", 3)):
        np.testing.assert_array_equal(np.moveaxis(a, 0, -1).squeeze(-1) if channels == 1 else np.moveaxis(a, 0, -1),
                                      np.asarray(img))  # 8-bit pixels pass through unchanged


@FAST
@given(st.integers(2, 5), st.integers(0, 2**16))
def test_animated_images_give_their_first_frame(frames, seed):
    rng = np.random.default_rng(seed)
    imgs = [Image.fromarray(rng.integers(0, 256, (6, 9, 3), dtype=np.uint8)).convert("P") for _ in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, format="GIF", save_all=True, append_images=imgs[1:])
    a = to_array(open_image(buf.getvalue()), 3)
    np.testing.assert_array_equal(a, to_array(imgs[0], 3))


@FAST
@given(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]), st.integers(2, 16), st.integers(2, 16))
def test_exif_orientation_is_applied(orientation, h, w):
    img = Image.fromarray(np.arange(h * w * 3, dtype=np.uint8).reshape(h, w, 3) % 255)
    exif = img.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, format="PNG", exif=exif)
    out = open_image(buf.getvalue())
    assert (out.height, out.width) == ((w, h) if orientation in (5, 6, 7, 8) else (h, w))


@FAST
@given(st.binary(max_size=300))
def test_garbage_is_a_bad_image_never_a_crash(data):
    try:
        open_image(data, "garbage.bin")
    except BadImageError as e:
        assert "garbage.bin" in str(e)
