// LstmGates / LstmGatesGrad: op registration and shape functions (the CPU
// kernels are cc/kernels/lstm_gates_kernels.cc). One LSTM time step's gate
// math fused into one op each way, for the per-step loop of SparseSplitLSTM
// (tf_sparse_split/layers/lstm.py), where a dozen small elementwise TF ops
// per step cost more executor time than their arithmetic.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::DimensionHandle;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

namespace {

// *out = shape `s` with its last dimension replaced by `last`.
absl::Status WithLastDim(InferenceContext* c, ShapeHandle s,
                         DimensionHandle last, ShapeHandle* out) {
  ShapeHandle prefix;
  TF_RETURN_IF_ERROR(c->Subshape(s, 0, -1, &prefix));
  return c->Concatenate(prefix, c->Vector(last), out);
}

// The prefix (all but the last dimension) of `s`, merged into *prefix.
absl::Status MergePrefix(InferenceContext* c, ShapeHandle s,
                         ShapeHandle* prefix) {
  ShapeHandle p;
  TF_RETURN_IF_ERROR(c->Subshape(s, 0, -1, &p));
  return c->Merge(*prefix, p, prefix);
}

}  // namespace

REGISTER_OP("TfSparseSplit>LstmGates")
    .Input("zx: T")
    .Input("zh: T")
    .Input("c_prev: T")
    .Output("h: T")
    .Output("c: T")
    .Output("saved: T")
    .Attr("T: {float, double, bfloat16, half}")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle z, c_prev, prefix;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &z));
      TF_RETURN_IF_ERROR(c->Merge(z, c->input(1), &z));
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(2), 1, &c_prev));
      TF_RETURN_IF_ERROR(c->Subshape(z, 0, -1, &prefix));
      TF_RETURN_IF_ERROR(MergePrefix(c, c_prev, &prefix));
      DimensionHandle units = c->Dim(c_prev, -1), four_units;
      TF_RETURN_IF_ERROR(c->Multiply(units, 4, &four_units));
      TF_RETURN_IF_ERROR(c->Merge(four_units, c->Dim(z, -1), &four_units));
      if (c->ValueKnown(four_units)) {
        if (c->Value(four_units) % 4 != 0)
          return tf::errors::InvalidArgument(
              "LstmGates: the last dimension of zx and zh (4 * units) must be "
              "a multiple of 4, got ", c->Value(four_units));
        TF_RETURN_IF_ERROR(c->Merge(units, c->MakeDim(c->Value(four_units) / 4),
                                    &units));
      }
      DimensionHandle six_units;
      TF_RETURN_IF_ERROR(c->Multiply(units, 6, &six_units));
      ShapeHandle state, saved;
      TF_RETURN_IF_ERROR(c->Concatenate(prefix, c->Vector(units), &state));
      TF_RETURN_IF_ERROR(c->Concatenate(prefix, c->Vector(six_units), &saved));
      c->set_output(0, state);
      c->set_output(1, state);
      c->set_output(2, saved);
      return absl::OkStatus();
    })
    .Doc(R"doc(
One LSTM step's gate math (sigmoid gates, tanh activations), fused.

With z = zx + zh split along the last axis into (i, f, o, g) -- gate order
input, forget, output, candidate, each `units` wide -- and
s_i = sigmoid(z_i), s_f = sigmoid(z_f), s_o = sigmoid(z_o), a = tanh(z_g):
  c = s_f * c_prev + s_i * a,  h = s_o * tanh(c).
Every row (all leading dimensions flattened) is independent; the bits do not
depend on the thread count.

zx, zh: [..., 4 * units] pre-activation parts (summed), same shape.
c_prev: [..., units] previous cell state.
h: [..., units] new hidden state.
c: [..., units] new cell state.
saved: [..., 6 * units] = (s_i, s_f, s_o, a, tanh(c), c_prev) along the last
  axis: what LstmGatesGrad needs (in float32/float64, h = s_o * tanh(c) can be
  recomputed from it bit for bit).
T: float32 and float64 compute in T; bfloat16 and half are widened to
  float32, the step is computed in float32 and each output is rounded once
  to T (round-to-nearest-even).
)doc");

REGISTER_OP("TfSparseSplit>LstmGatesGrad")
    .Input("saved: T")
    .Input("dh_rec: T")
    .Input("dh_out: T")
    .Input("dc: T")
    .Output("dz: T")
    .Output("dc_prev: T")
    .Attr("T: {float, double, bfloat16, half}")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle saved, dh_rec, dh_out, dc, prefix;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &saved));
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), 1, &dh_rec));
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(2), 1, &dh_out));
      TF_RETURN_IF_ERROR(c->Merge(dh_out, c->input(3), &dc));
      TF_RETURN_IF_ERROR(c->Subshape(dc, 0, -1, &prefix));
      TF_RETURN_IF_ERROR(MergePrefix(c, saved, &prefix));
      TF_RETURN_IF_ERROR(MergePrefix(c, dh_rec, &prefix));
      DimensionHandle units = c->Dim(dc, -1), six_units;
      TF_RETURN_IF_ERROR(c->Multiply(units, 6, &six_units));
      TF_RETURN_IF_ERROR(c->Merge(six_units, c->Dim(saved, -1), &six_units));
      if (c->ValueKnown(six_units)) {
        if (c->Value(six_units) % 6 != 0)
          return tf::errors::InvalidArgument(
              "LstmGatesGrad: the last dimension of saved (6 * units) must be "
              "a multiple of 6, got ", c->Value(six_units));
        TF_RETURN_IF_ERROR(c->Merge(units, c->MakeDim(c->Value(six_units) / 6),
                                    &units));
      }
      DimensionHandle rec = c->Dim(dh_rec, -1);
      if (c->ValueKnown(rec) && c->ValueKnown(units) &&
          c->Value(rec) > c->Value(units))
        return tf::errors::InvalidArgument(
            "LstmGatesGrad: dh_rec has ", c->Value(rec),
            " columns, more than units = ", c->Value(units));
      DimensionHandle four_units;
      TF_RETURN_IF_ERROR(c->Multiply(units, 4, &four_units));
      ShapeHandle dz, state;
      TF_RETURN_IF_ERROR(c->Concatenate(prefix, c->Vector(four_units), &dz));
      TF_RETURN_IF_ERROR(c->Concatenate(prefix, c->Vector(units), &state));
      c->set_output(0, dz);
      c->set_output(1, state);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Gradient of LstmGates: dz (for zx and zh alike) and dc_prev.

With dh = dh_rec (zero-extended to `units` columns) + dh_out and the
activations in `saved` (LstmGates' output):
  dc_t = dc + dh * s_o * (1 - tanh(c)^2)
  dz = (dc_t * a * s_i * (1 - s_i), dc_t * c_prev * s_f * (1 - s_f),
        dh * tanh(c) * s_o * (1 - s_o), dc_t * s_i * (1 - a^2))
  dc_prev = dc_t * s_f.

saved: [..., 6 * units] from LstmGates.
dh_rec: [..., k], k <= units: gradient of h on its first k units (e.g. the
  recurrent product's input gradient when only k units enter it); the other
  units get none from it.
dh_out: [..., units] further gradient of h (e.g. from the layer's outputs).
dc: [..., units] gradient of c.
dz: [..., 4 * units] gradient of the pre-activations (gate order i, f, o, g).
dc_prev: [..., units] gradient of c_prev.
T: as in LstmGates (bfloat16/half: float32 arithmetic, outputs rounded once).
)doc");

}  // namespace tf_sparse_split
