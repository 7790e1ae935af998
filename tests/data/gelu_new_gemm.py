# GPT-2's MLP-up kernel as tvmfuse fuses it (fp16; gelu_new over a reshaped product, its constants 0-d
# parameters), from the GPT-2 124M prefill-512 export, shapes shrunk to 128 x 96 x 64 (M x N x K).
# from tvm.script import tirx as T

@T.prim_func(private=True, s_tir=True)
def main(param_0: T.Buffer((T.int64(96), T.int64(64)), "float16"), lv14_1: T.Buffer((T.int64(128), T.int64(64)), "float16"), param_1: T.Buffer((T.int64(96),), "float16"), param_3: T.Buffer((), "float32"), param_4: T.Buffer((), "float16"), param_5: T.Buffer((), "float16"), param_6: T.Buffer((), "float16"), param_7: T.Buffer((), "float16"), T_multiply_intermediate_1_2_3: T.Buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")):
    T.func_attr({"tirx.noalias": True})
    # with T.sblock("root"):
    T_transpose_intermediate = T.sblock_alloc_buffer((T.int64(64), T.int64(96)), "float16")
    matmul_intermediate = T.sblock_alloc_buffer((T.int64(128), T.int64(96)))
    compute_intermediate = T.sblock_alloc_buffer((T.int64(128), T.int64(96)), "float16")
    T_add_intermediate = T.sblock_alloc_buffer((T.int64(128), T.int64(96)), "float16")
    T_reshape_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    compute_intermediate_1 = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)))
    T_power_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)))
    compute_intermediate_1_2 = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    T_multiply_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    T_add_intermediate_1 = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    T_multiply_intermediate_1 = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    compute_intermediate_1_2_3 = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    T_multiply_intermediate_1_2 = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    T_add_intermediate_1_2 = T.sblock_alloc_buffer((T.int64(1), T.int64(128), T.int64(96)), "float16")
    for ax0, ax1 in T.grid(T.int64(64), T.int64(96)):
        with T.sblock("T_transpose"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(param_0[v_ax1, v_ax0])
            T.writes(T_transpose_intermediate[v_ax0, v_ax1])
            T_transpose_intermediate[v_ax0, v_ax1] = param_0[v_ax1, v_ax0]
    for i0, i1, k in T.grid(T.int64(128), T.int64(96), T.int64(64)):
        with T.sblock("matmul"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            T.reads(lv14_1[v_i0, v_k], T_transpose_intermediate[v_k, v_i1])
            T.writes(matmul_intermediate[v_i0, v_i1])
            with T.init():
                matmul_intermediate[v_i0, v_i1] = T.float32(0.0)
            matmul_intermediate[v_i0, v_i1] = matmul_intermediate[v_i0, v_i1] + T.Cast("float32", lv14_1[v_i0, v_k]) * T.Cast("float32", T_transpose_intermediate[v_k, v_i1])
    for i0, i1 in T.grid(T.int64(128), T.int64(96)):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(matmul_intermediate[v_i0, v_i1])
            T.writes(compute_intermediate[v_i0, v_i1])
            compute_intermediate[v_i0, v_i1] = T.Cast("float16", matmul_intermediate[v_i0, v_i1])
    for ax0, ax1 in T.grid(T.int64(128), T.int64(96)):
        with T.sblock("T_add"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(compute_intermediate[v_ax0, v_ax1], param_1[v_ax1])
            T.writes(T_add_intermediate[v_ax0, v_ax1])
            T_add_intermediate[v_ax0, v_ax1] = compute_intermediate[v_ax0, v_ax1] + param_1[v_ax1]
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_reshape"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_add_intermediate[(v_ax2 // T.int64(96) + v_ax1) % T.int64(128), v_ax2 % T.int64(96)])
            T.writes(T_reshape_intermediate[v_ax0, v_ax1, v_ax2])
            T_reshape_intermediate[v_ax0, v_ax1, v_ax2] = T_add_intermediate[(v_ax2 // T.int64(96) + v_ax1) % T.int64(128), v_ax2 % T.int64(96)]
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("compute1"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(T_reshape_intermediate[v_i0, v_i1, v_i2])
            T.writes(compute_intermediate_1[v_i0, v_i1, v_i2])
            compute_intermediate_1[v_i0, v_i1, v_i2] = T.Cast("float32", T_reshape_intermediate[v_i0, v_i1, v_i2])
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_power"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(compute_intermediate_1[v_i0, v_i1, v_i2], param_3[()])
            T.writes(T_power_intermediate[v_i0, v_i1, v_i2])
            T_power_intermediate[v_i0, v_i1, v_i2] = T.if_then_else(compute_intermediate_1[v_i0, v_i1, v_i2] < T.float32(0.0) and param_3[()] - T.floor(param_3[()] * T.float32(0.5)) * T.float32(2.0) == T.float32(1.0), T.pow(T.fabs(compute_intermediate_1[v_i0, v_i1, v_i2]), param_3[()]) * T.float32(-1.0), T.pow(T.fabs(compute_intermediate_1[v_i0, v_i1, v_i2]), param_3[()]))
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("compute2"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(T_power_intermediate[v_i0, v_i1, v_i2])
            T.writes(compute_intermediate_1_2[v_i0, v_i1, v_i2])
            compute_intermediate_1_2[v_i0, v_i1, v_i2] = T.Cast("float16", T_power_intermediate[v_i0, v_i1, v_i2])
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_multiply"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(compute_intermediate_1_2[v_ax0, v_ax1, v_ax2], param_4[()])
            T.writes(T_multiply_intermediate[v_ax0, v_ax1, v_ax2])
            T_multiply_intermediate[v_ax0, v_ax1, v_ax2] = compute_intermediate_1_2[v_ax0, v_ax1, v_ax2] * param_4[()]
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_add1"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_reshape_intermediate[v_ax0, v_ax1, v_ax2], T_multiply_intermediate[v_ax0, v_ax1, v_ax2])
            T.writes(T_add_intermediate_1[v_ax0, v_ax1, v_ax2])
            T_add_intermediate_1[v_ax0, v_ax1, v_ax2] = T_reshape_intermediate[v_ax0, v_ax1, v_ax2] + T_multiply_intermediate[v_ax0, v_ax1, v_ax2]
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_multiply1"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_add_intermediate_1[v_ax0, v_ax1, v_ax2], param_5[()])
            T.writes(T_multiply_intermediate_1[v_ax0, v_ax1, v_ax2])
            T_multiply_intermediate_1[v_ax0, v_ax1, v_ax2] = T_add_intermediate_1[v_ax0, v_ax1, v_ax2] * param_5[()]
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("compute3"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(T_multiply_intermediate_1[v_i0, v_i1, v_i2])
            T.writes(compute_intermediate_1_2_3[v_i0, v_i1, v_i2])
            compute_intermediate_1_2_3[v_i0, v_i1, v_i2] = T.tanh(T_multiply_intermediate_1[v_i0, v_i1, v_i2])
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_multiply2"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_reshape_intermediate[v_ax0, v_ax1, v_ax2], param_6[()])
            T.writes(T_multiply_intermediate_1_2[v_ax0, v_ax1, v_ax2])
            T_multiply_intermediate_1_2[v_ax0, v_ax1, v_ax2] = T_reshape_intermediate[v_ax0, v_ax1, v_ax2] * param_6[()]
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_add2"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(compute_intermediate_1_2_3[v_ax0, v_ax1, v_ax2], param_7[()])
            T.writes(T_add_intermediate_1_2[v_ax0, v_ax1, v_ax2])
            T_add_intermediate_1_2[v_ax0, v_ax1, v_ax2] = compute_intermediate_1_2_3[v_ax0, v_ax1, v_ax2] + param_7[()]
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(128), T.int64(96)):
        with T.sblock("T_multiply3"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_multiply_intermediate_1_2[v_ax0, v_ax1, v_ax2], T_add_intermediate_1_2[v_ax0, v_ax1, v_ax2])
            T.writes(T_multiply_intermediate_1_2_3[v_ax0, v_ax1, v_ax2])
            T_multiply_intermediate_1_2_3[v_ax0, v_ax1, v_ax2] = T_multiply_intermediate_1_2[v_ax0, v_ax1, v_ax2] * T_add_intermediate_1_2[v_ax0, v_ax1, v_ax2]