"""TensorFlow op wrappers and their registered gradients.

* :func:`sparse_split_matmul` (:mod:`tf_sparse_split.ops.matmul`) -- the
  ``SparseSplitMatMul`` op.
* :func:`sparse_split_conv2d` (:mod:`tf_sparse_split.ops.conv2d`) -- the
  ``SparseSplitConv2D`` op (NHWC) and its filter-gradient op;
  :func:`sparse_split_conv2d_backprop_input` -- its stride-1 input gradient
  (``SparseSplitConv2DBackpropInput``).
* :func:`sparse_split_sddmm` (:mod:`tf_sparse_split.ops.sddmm`) -- the
  ``SparseSplitSddmm`` op (masked input gradient behind ReLU).
* :func:`bias_fat_relu` (:mod:`tf_sparse_split.ops.fat_relu`) -- bias add +
  FATReLU (+ the L1 penalty's sum) in one pass, and its gradient
  (``BiasFatRelu`` / ``BiasFatReluGrad``; used by ``SparseSplitConv2D``).
* :func:`lstm_gates`, :func:`lstm_gates_grad`
  (:mod:`tf_sparse_split.ops.lstm_gates`) -- one LSTM step's gate math
  fused (``LstmGates`` / ``LstmGatesGrad``; used by ``SparseSplitLSTM``).

Importing this package registers the gradients (``tf.RegisterGradient``).
"""

from tf_sparse_split.ops.matmul import sparse_split_matmul
from tf_sparse_split.ops.conv2d import (sparse_split_conv2d,
                                        sparse_split_conv2d_backprop_input)
from tf_sparse_split.ops.sddmm import sparse_split_sddmm
from tf_sparse_split.ops.fat_relu import bias_fat_relu
from tf_sparse_split.ops.lstm_gates import lstm_gates, lstm_gates_grad

__all__ = ["sparse_split_matmul", "sparse_split_conv2d",
           "sparse_split_conv2d_backprop_input", "sparse_split_sddmm",
           "bias_fat_relu", "lstm_gates", "lstm_gates_grad"]
