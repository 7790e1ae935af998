"""TIR expression node classes the kernel generators rebuild epilogues from (TVM 0.27 names some only by instance)."""

from tvm import tirx

#: a tensor load (tirx.BufferLoad builds a tvm.ir TensorLoad in TVM 0.27) and an intrinsic call
LOAD = type(tirx.BufferLoad(tirx.decl_buffer((1,), "float32"), [0]))
CALL = type(tirx.op.exp(tirx.const(0.0, "float32")))
#: binary nodes rebuilt as type(e)(a, b)
BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Max, tirx.Min, tirx.FloorDiv, tirx.FloorMod, tirx.Mod,
          tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or)
