"""Bad inputs to the convolution ops: sizes near 2^31 that crashed the
process (a floating-point exception or a segmentation fault in
TensorFlow's dense kernel, an abort in ``TensorShape``), and strides,
dilations, paddings and filter dtypes that the wrapper truncated or cast
silently. Each must raise ``InvalidArgumentError`` naming the argument,
and the sizes just inside the limits must still give ``tf.nn.conv2d``'s
answer."""

import json

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from _helpers import run_python

pytestmark = pytest.mark.usefixtures("op_library")

conv = tfss.sparse_split_conv2d


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
    x[rng.random(x.shape) < 0.6] = 0.0          # real zeros, not all zero
    f = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    return x, f


# Each case ran in a process of its own before the fix and killed it; they
# run here in one child process, so that a regression fails this test
# instead of ending the test session.
_CRASHERS = r'''
import json, sys
import numpy as np, tensorflow as tf
import tf_sparse_split as tfss
lib = tfss.load_library()
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
x[rng.random(x.shape) < 0.6] = 0
f = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
dy = rng.standard_normal((2, 8, 8, 4)).astype(np.float32)
S = dict(strides=[1, 1, 1, 1])
cases = {
  # SIGFPE in TensorFlow's dense convolution (threshold 0: all dense).
  "wrapper-dilation-2^31-1": lambda: tfss.sparse_split_conv2d(
      x, f, 1, "SAME", dilations=2**31 - 1, threshold=0.0),
  "raw-dilation-2^31-1": lambda: lib.tf_sparse_split_sparse_split_conv2d(
      x, f, 0.0, [], padding="SAME", dilations=[1, 2**31 - 1, 2**31 - 1, 1],
      **S),
  # Segmentation faults: a padded input side above 2^31.
  "wrapper-explicit-2^30-each-side": lambda: tfss.sparse_split_conv2d(
      x, f, 1, [[0, 0], [2**30, 2**30], [0, 1], [0, 0]], threshold=0.0),
  "raw-explicit-2^30-each-side": lambda: lib.tf_sparse_split_sparse_split_conv2d(
      x, f, -1.0, [], padding="EXPLICIT",
      explicit_paddings=[0, 0, 2**30, 2**30, 0, 0, 0, 0], **S),
  # Abort: the output shape's element count overflowed int64.
  "raw-output-overflows": lambda: lib.tf_sparse_split_sparse_split_conv2d(
      x, f, 0.0, [], padding="EXPLICIT",
      explicit_paddings=[0, 0, 2**30, 2**30, 2**30, 2**30, 0, 0], **S),
  # Segmentation fault: a filter of 2^31 - 1 rows in the filter gradient.
  "raw-filter-grad-kh-2^31-1": lambda:
      lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
          x, [2**31 - 1, 3, 3, 4], dy, -1.0, padding="SAME", **S),
  # Abort in ReadSizes4: [N, H, W] of 2^31 - 1 overflow int64 together.
  "wrapper-input-sizes-overflow": lambda:
      tfss.sparse_split_conv2d_backprop_input(
          [2**31 - 1, 2**31 - 1, 2**31 - 1, 3], f, dy, "SAME"),
  "raw-input-sizes-overflow": lambda:
      lib.tf_sparse_split_sparse_split_conv2d_backprop_input(
          [2**31 - 1, 2**31 - 1, 2**31 - 1, 3], f, dy, -1.0,
          padding="SAME", **S),
}
out = {}
for name, fn in cases.items():
    print(name, file=sys.stderr, flush=True)   # the last one on a crash
    try:
        fn()
        out[name] = "no error"
    except tf.errors.InvalidArgumentError as e:
        out[name] = "InvalidArgumentError: " + e.message
    except Exception as e:
        out[name] = type(e).__name__ + ": " + str(e)
print("RESULT" + json.dumps(out))
'''

_EXPECTED = {
    "wrapper-dilation-2^31-1": "dilat",
    "raw-dilation-2^31-1": "dilat",
    "wrapper-explicit-2^30-each-side": "padded input",
    "raw-explicit-2^30-each-side": "padded input",
    "raw-output-overflows": "padded input",
    "raw-filter-grad-kh-2^31-1": "dilated filter",
    "wrapper-input-sizes-overflow": "input_sizes",
    "raw-input-sizes-overflow": "input_sizes",
}


def test_sizes_near_2_31_raise_instead_of_crashing():
    proc = run_python(_CRASHERS)
    assert proc.returncode == 0, (
        f"the process died (code {proc.returncode}) in case "
        f"{proc.stderr.strip().splitlines()[-1:]}")
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    got = json.loads(line[0][len("RESULT"):])
    for name, word in _EXPECTED.items():
        assert got[name].startswith("InvalidArgumentError"), (name, got[name])
        assert word in got[name], (name, got[name])


def _reference(x, f, strides, dilations, padding):
    """NHWC/HWIO convolution in float64 numpy, tap by tap (TensorFlow's
    SAME: the extra padding after), for dilations far beyond the input."""
    x, f = x.astype(np.float64), f.astype(np.float64)
    n, h, w, _ = x.shape
    kh, kw, _, co = f.shape
    (sh, sw), (dh, dw) = strides, dilations
    ek_h, ek_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    if padding == "SAME":
        oh, ow = -(-h // sh), -(-w // sw)
        pt = max((oh - 1) * sh + ek_h - h, 0) // 2
        pl = max((ow - 1) * sw + ek_w - w, 0) // 2
    else:  # [[0, 0], [top, bottom], [left, right], [0, 0]]
        (pt, pb), (pl, pr) = padding[1], padding[2]
        oh = (h + pt + pb - ek_h) // sh + 1
        ow = (w + pl + pr - ek_w) // sw + 1
    out = np.zeros((n, oh, ow, co))
    for i in range(kh):
        for j in range(kw):
            for a in range(oh):
                r = a * sh + i * dh - pt
                for b in range(ow):
                    c = b * sw + j * dw - pl
                    if 0 <= r < h and 0 <= c < w:
                        out[:, a, b] += x[:, r, c] @ f[i, j]
    return out


@pytest.mark.parametrize("strides, dilations, padding", [
    ((1, 1), (2**28, 2**28), "SAME"),      # a padded side of 2^29 + 8
    ((2, 1), (2**20, 3), "SAME"),
    ((1, 2), (1, 1), [[0, 0], [5, 2], [0, 3], [0, 0]]),
], ids=["dilation-2^28", "stride-dilation", "explicit"])
@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_large_but_valid_sizes_still_give_the_convolution(
        strides, dilations, padding, threshold):
    x, f = _operands(1)
    got = conv(x, f, list(strides), padding, dilations=list(dilations),
               threshold=threshold)
    np.testing.assert_allclose(
        got, _reference(x, f, strides, dilations, padding),
        rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(strides=[1.5, 1]), "strides must be ints"),
    (dict(strides="12"), "strides"),             # was [1, 2]
    (dict(strides="1"), "strides"),
    (dict(strides=[1, True]), "strides must be ints"),
    (dict(dilations=[2.0, 1]), "dilations must be ints"),
    (dict(strides=2**31), "strides"),
    (dict(padding=[[0, 0], [1.7, 1], [1, 1], [0, 0]]), "pairs of ints"),
    (dict(padding=[[0, 0], ["1", 1], [1, 1], [0, 0]]), "pairs of ints"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 0, 1.7, 1, 1, 1, 0, 0]),
     "explicit_paddings must be ints"),
    (dict(padding="EXPLICIT", explicit_paddings="abc"),
     "explicit_paddings must be ints"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 0, 2**63, 1, 1, 1, 0, 0]),
     "explicit_paddings"),
    (dict(padding=[[0, 0], [2**30 + 1, 0], [0, 0], [0, 0]]), "2\\^30"),
], ids=["float-stride", "str-12", "str-1", "bool-in-list", "float-dilation",
        "stride-2^31", "float-pad", "str-pad", "float-explicit",
        "str-explicit", "explicit-2^63", "pad-above-2^30"])
def test_non_integer_or_huge_attrs_are_refused(kwargs, match):
    x, f = _operands(2)
    args = dict(strides=1, padding="SAME")
    args.update(kwargs)
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        conv(x, f, **args)


def test_integer_attrs_of_numpy_and_tensor_types_still_work():
    x, f = _operands(3)
    want = tf.nn.conv2d(x.astype(np.float64), f.astype(np.float64), [1, 2],
                        [[0, 0], [1, 1], [2, 0], [0, 0]])
    for strides in ([np.int64(1), 2], np.array([1, 2]), (1, tf.constant(2))):
        got = conv(x, f, strides, [[0, 0], [np.int32(1), 1], [2, 0], [0, 0]],
                   threshold=1.0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_float64_filter_with_float32_input_is_an_error():
    """A numpy float64 filter was cast to the input's float32 silently
    (``convert_to_tensor``'s dtype hint); a Python list still takes the
    input's dtype."""
    x, f = _operands(4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="filters"):
        conv(x, f.astype(np.float64), 1, "SAME")
    got = conv(x, f.tolist(), 1, "SAME")
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got, tf.nn.conv2d(x, f, 1, "SAME"),
                               rtol=1e-5, atol=1e-5)
