"""Hand-vectorised attention loops for the CPU backend, written as LLVM IR:
int4 rows and 16-bit float (fp16, bf16) rows.

The generic loops in `cpu_kernels` decode a chunk of rows into a float32
buffer and then read it back for the dot products or the value sums, and
their dot products end in one horizontal sum per accumulator. LLVM cannot
fuse those phases: its loop vectoriser vectorises innermost loops only, and
it keeps no array element in a register across a loop that writes another
array it cannot prove distinct. Here the vectors are explicit: each stored
value is converted to float32 in registers and consumed there by eight
independent FMA chains, the number two FMA units of latency 4 keep busy.

The IR uses generic 8-lane vectors and LLVM's fma intrinsic, which LLVM
lowers to what the host has: ymm registers and vfmadd on AVX2 (the target
it is tuned for); narrower registers elsewhere, and on a CPU without FMA a correct
but slow library call per lane. Likewise `fpext <8 x half>` is one vcvtph2ps
with F16C (every AVX2 CPU has it), a library call per lane without.

Layout contract (checked by the callers in `cpu_kernels`): the cache is a
4-D array [block, row, head, element] whose elements within a row are
contiguous (rows may be strided, as in the vLLM layout with inline scales).
A row of d values is read as two halves, elements j and half + j (half =
d / 2, a multiple of 8) taken together:
- int4: a row is `half` bytes; byte j holds element j of the storage order
  in its low nibble and element half + j in its high nibble.
- fp16 / bf16: a row is d 16-bit values (a uint16 view), in model order.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 8           # values per half-row tile, float32 lanes per vector

_f32 = ir.FloatType()
_i32 = ir.IntType(32)
_i8 = ir.IntType(8)
_vf32 = ir.VectorType(_f32, LANES)
_vi32 = ir.VectorType(_i32, LANES)
_vi8 = ir.VectorType(_i8, LANES)
_vi16 = ir.VectorType(ir.IntType(16), LANES)
_vf16 = ir.VectorType(ir.HalfType(), LANES)


def _splat(builder, scalar, vector_type):
    """A vector with `scalar` in every lane."""
    single = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, _i32(0))
    return builder.shuffle_vector(single, ir.Constant(vector_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_i32, LANES), [0] * LANES))


def _fma(builder, a, b, c):
    """a * b + c, fused, lane by lane."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_vf32, [_vf32] * 3),
                                         "llvm.fma.v8f32")
    return builder.call(fma, [a, b, c])


def _unpack(builder, data, byte_offset, zero_point):
    """(low, high) nibbles of the 8 bytes at data + byte_offset (data: i8*), each minus
    zero_point (an int32 vector), as float32 vectors. The subtraction is exact in int32."""
    pointer = builder.bitcast(builder.gep(data, [byte_offset]), _vi8.as_pointer())
    codes = builder.zext(builder.load(pointer, align=1), _vi32)
    low = builder.and_(codes, ir.Constant(_vi32, [15] * LANES))
    high = builder.lshr(codes, ir.Constant(_vi32, [4] * LANES))
    return (builder.sitofp(builder.sub(low, zero_point), _vf32),
            builder.sitofp(builder.sub(high, zero_point), _vf32))


def _load_halves(builder, data, byte_offset):
    """The 8 16-bit values at data + byte_offset (data: i8*), as an <8 x i16>."""
    pointer = builder.bitcast(builder.gep(data, [byte_offset]), _vi16.as_pointer())
    return builder.load(pointer, align=2)


def _float16_to_float32(builder, bits):
    """float32 vector of 8 IEEE half bits: exact (every half is a float32), one
    vcvtph2ps with F16C, subnormals, infinities and NaNs included."""
    return builder.fpext(builder.bitcast(bits, _vf16), _vf32)


def _bfloat16_to_float32(builder, bits):
    """float32 vector of 8 bfloat16 bits: they are float32's upper half."""
    return builder.bitcast(builder.shl(builder.zext(bits, _vi32), ir.Constant(_vi32, [16] * LANES)), _vf32)


def _load_vector(builder, pointer, index):
    """The 8 float32 at pointer + index (unaligned)."""
    return builder.load(builder.bitcast(builder.gep(pointer, [index]), _vf32.as_pointer()), align=4)


def _store_vector(builder, value, pointer, index):
    builder.store(value, builder.bitcast(builder.gep(pointer, [index]), _vf32.as_pointer()), align=4)


def _sum_four(builder, vectors):
    """[sum(v0), sum(v1), sum(v2), sum(v3)] of four 8-lane vectors, by a transposing
    tree: 3 adds and 6 shuffles instead of four separate 3-level reductions."""
    def mask(lanes):
        return ir.Constant(ir.VectorType(_i32, len(lanes)), lanes)

    def pair(a, b, first, second):
        return builder.fadd(builder.shuffle_vector(a, b, mask(first)),
                            builder.shuffle_vector(a, b, mask(second)))

    # Lanes [a0+a1, b0+b1, a2+a3, b2+b3, ...] for (v0, v1) and for (v2, v3).
    evens, odds = [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]
    p01 = pair(vectors[0], vectors[1], evens, odds)
    p23 = pair(vectors[2], vectors[3], evens, odds)
    # Lanes [v0 0:4, v1 0:4, v2 0:4, v3 0:4, v0 4:8, v1 4:8, v2 4:8, v3 4:8] (partial sums).
    quads = pair(p01, p23, [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
    return pair(quads, quads, [0, 1, 2, 3], [4, 5, 6, 7])


def _array_pointer(context, builder, array_type, value):
    return context.make_array(array_type)(context, builder, value)


def _first_row(context, builder, array_type, array, block, offset, head):
    """(i8* to data[block, offset, head, 0], bytes from one row to the next)."""
    intp = block.type
    pointer = cgutils.get_item_pointer(context, builder, array_type, array, [block, offset, head, intp(0)],
                                       wraparound=False)
    row_stride = cgutils.unpack_tuple(builder, array.strides, 4)[1]
    return builder.bitcast(pointer, _i8.as_pointer()), row_stride


def _as_intp(context, builder, values, value_types):
    return [context.cast(builder, value, value_type, types.intp)
            for value, value_type in zip(values, value_types)]


class _Operands:
    """What every intrinsic takes first: (matrix, matrix_row, data, block, offset,
    head, n, ...), matrix being float32 [rows, d] (q or acc)."""

    def __init__(self, context, builder, sig, args):
        self.matrix = _array_pointer(context, builder, sig.args[0], args[0])
        row, block, offset, head, self.n = _as_intp(context, builder, [args[i] for i in (1, 3, 4, 5, 6)],
                                                    [sig.args[i] for i in (1, 3, 4, 5, 6)])
        data = _array_pointer(context, builder, sig.args[2], args[2])
        self.rows_base, self.row_stride = _first_row(context, builder, sig.args[2], data, block, offset, head)
        self.intp = self.n.type
        self.d = cgutils.unpack_tuple(builder, self.matrix.shape, 2)[1]
        self.half = builder.lshr(self.d, self.intp(1))
        # The matrix's row `row`, where the heads' rows start.
        self.base = builder.gep(self.matrix.data, [builder.mul(row, self.d)])


def _is_c_array(value, dtype, ndim):
    return isinstance(value, types.Array) and value.dtype == dtype and value.ndim == ndim and value.layout == "C"


def _is_cache(value):
    """A 4-D cache array of any element type and layout (see _first_row)."""
    return isinstance(value, types.Array) and value.ndim == 4


# How each kind of row turns into float32 vectors: row_state(builder, arrays,
# row) is what tile() needs of row `row` (arrays: the intrinsic's per-row
# arrays), row_scale() the factor of its score (None: none), and tile() the
# two float32 vectors of a row's values column .. column + 7 and half +
# column .. half + column + 7. The attention kernel is typed for every cache
# dtype but calls a kind's loops on its storage dtype only (uint8 for int4,
# uint16 for fp16 and bf16): for the others the loops compile to nothing,
# which saves compile time.

class _Int4Rows:
    """int4 rows: per-row zero-points (int32 [n]) for both loops, and per-row
    scales (float32 [n]) for the scores; the value loop takes them folded into
    its weights."""
    storage = types.uint8
    score_arrays = (types.int32, types.float32)   # zero_points, scales
    accumulate_arrays = (types.int32,)            # zero_points

    @staticmethod
    def row_state(builder, arrays, row):
        return _splat(builder, builder.load(builder.gep(arrays[0].data, [row])), _vi32)

    @staticmethod
    def row_scale(builder, arrays, row):
        return builder.load(builder.gep(arrays[1].data, [row]))

    @staticmethod
    def tile(builder, rows_base, row_start, column, half, zero_point):
        """Both vectors come from the 8 bytes at row_start + column."""
        return _unpack(builder, rows_base, builder.add(row_start, column), zero_point)


class _HalfFloatRows:
    """fp16 or bf16 rows, unscaled ("auto" caches)."""
    storage = types.uint16
    score_arrays = ()
    accumulate_arrays = ()

    def __init__(self, to_float32):
        self.to_float32 = to_float32

    @staticmethod
    def row_state(builder, arrays, row):
        return None

    @staticmethod
    def row_scale(builder, arrays, row):
        return None

    def tile(self, builder, rows_base, row_start, column, half, state):
        """Two 16-byte loads, 2 * column and 2 * (half + column) bytes into the row."""
        intp = column.type
        return tuple(self.to_float32(builder, _load_halves(builder, rows_base,
                                                           builder.add(row_start, builder.shl(element, intp(1)))))
                     for element in (column, builder.add(half, column)))


INT4_ROWS = _Int4Rows()
FLOAT16_ROWS = _HalfFloatRows(_float16_to_float32)
BFLOAT16_ROWS = _HalfFloatRows(_bfloat16_to_float32)


def _arrays_match(values, dtypes):
    return len(values) == len(dtypes) and all(_is_c_array(v, t, 1) for v, t in zip(values, dtypes))


# Rows a scores step takes, and whether a (head, row) keeps its two half-row
# sums in one accumulator, per count of heads: 8 accumulators each. With 4
# heads, two rows in 8 shared accumulators beat one row in 8 split ones for
# int4 (the q loads serve two rows); 4 rows would need 16 and spill.
SCORE_STEPS = {4: (2, True), 2: (2, False), 1: (4, False)}


def _scores_codegen(row_kind, heads):
    rows, merged = SCORE_STEPS[heads]
    parts = 1 if merged else 2
    out_arg = 7 + len(row_kind.score_arrays)

    def codegen(context, builder, sig, args):
        if sig.args[2].dtype != row_kind.storage:
            return context.get_dummy_value()
        operands = _Operands(context, builder, sig, args)
        row_arrays = [_array_pointer(context, builder, sig.args[i], args[i]) for i in range(7, out_arg)]
        out_array = _array_pointer(context, builder, sig.args[out_arg], args[out_arg])
        q_row_, out_col_ = _as_intp(context, builder, [args[1], args[out_arg + 1]],
                                    [sig.args[1], sig.args[out_arg + 1]])
        intp, n_, d, half = operands.intp, operands.n, operands.d, operands.half
        rows_base, row_stride_, q_base = operands.rows_base, operands.row_stride, operands.base
        out_width = cgutils.unpack_tuple(builder, out_array.shape, 2)[1]
        accumulators = [cgutils.alloca_once(builder, _vf32) for _ in range(heads * rows * parts)]
        steps = builder.udiv(builder.add(n_, intp(rows - 1)), intp(rows))
        with cgutils.for_range(builder, steps) as step:
            first = builder.mul(step.index, intp(rows))
            last = builder.sub(n_, intp(1))
            row_indices = []
            for k in range(rows):
                index = builder.add(first, intp(k))
                row_indices.append(builder.select(builder.icmp_signed("<", index, n_), index, last))
            row_starts = [builder.mul(r, row_stride_) for r in row_indices]
            states = [row_kind.row_state(builder, row_arrays, r) for r in row_indices]
            for accumulator in accumulators:
                builder.store(ir.Constant(_vf32, None), accumulator)
            with cgutils.for_range(builder, builder.udiv(half, intp(LANES))) as tile:
                column = builder.mul(tile.index, intp(LANES))
                values = [row_kind.tile(builder, rows_base, start, column, half, state)
                          for start, state in zip(row_starts, states)]
                for h in range(heads):
                    q_first = _load_vector(builder, q_base, builder.add(builder.mul(intp(h), d), column))
                    q_second = _load_vector(builder, q_base, builder.add(builder.mul(intp(h), d),
                                                                         builder.add(half, column)))
                    for k in range(rows):
                        for part, (qv, value) in enumerate(zip((q_first, q_second), values[k])):
                            slot = accumulators[(h * rows + k) * parts + part % parts]
                            builder.store(_fma(builder, qv, value, builder.load(slot)), slot)
            # Each (head, row) dot product (its two halves), then four sums at a time.
            products = [builder.load(accumulators[j * parts]) for j in range(heads * rows)]
            if not merged:
                products = [builder.fadd(low, builder.load(accumulators[j * 2 + 1]))
                            for j, low in enumerate(products)]
            sums = [_sum_four(builder, products[j:j + 4]) for j in range(0, len(products), 4)]
            for h in range(heads):
                out_row = builder.gep(out_array.data, [builder.mul(builder.add(q_row_, intp(h)), out_width)])
                for k in range(rows):
                    j = h * rows + k
                    value = builder.extract_element(sums[j // 4], _i32(j % 4))
                    scale = row_kind.row_scale(builder, row_arrays, row_indices[k])
                    if scale is not None:
                        value = builder.fmul(value, scale)
                    builder.store(value, builder.gep(out_row, [builder.add(out_col_, builder.add(first, intp(k)))]))
        return context.get_dummy_value()

    return codegen


def _accumulate_codegen(row_kind, heads):
    tiles = 4 // heads
    weights_arg = 7 + len(row_kind.accumulate_arrays)

    def codegen(context, builder, sig, args):
        if sig.args[2].dtype != row_kind.storage:
            return context.get_dummy_value()
        operands = _Operands(context, builder, sig, args)
        row_arrays = [_array_pointer(context, builder, sig.args[i], args[i]) for i in range(7, weights_arg)]
        weight_array = _array_pointer(context, builder, sig.args[weights_arg], args[weights_arg])
        weight_position = list(range(weights_arg + 1, len(args)))   # (weight_row[, weight_col])
        weight_row_, *weight_col_ = _as_intp(context, builder, [args[i] for i in weight_position],
                                             [sig.args[i] for i in weight_position])
        intp, n_, d, half = operands.intp, operands.n, operands.d, operands.half
        rows_base, row_stride_, acc_base = operands.rows_base, operands.row_stride, operands.base
        weight_width = cgutils.unpack_tuple(builder, weight_array.shape, 2)[1]
        weight_base = builder.gep(weight_array.data, [builder.mul(weight_row_, weight_width)])
        if weight_col_:
            weight_base = builder.gep(weight_base, weight_col_)
        accumulators = [cgutils.alloca_once(builder, _vf32) for _ in range(2 * heads * tiles)]

        def tile_group(first_tile, count):
            """Columns of `count` tiles from first_tile, over all n rows."""
            columns = [builder.mul(builder.add(first_tile, intp(t)), intp(LANES)) for t in range(count)]
            for accumulator in accumulators:
                builder.store(ir.Constant(_vf32, None), accumulator)
            with cgutils.for_range(builder, n_) as row:
                start = builder.mul(row.index, row_stride_)
                state = row_kind.row_state(builder, row_arrays, row.index)
                values = [row_kind.tile(builder, rows_base, start, c, half, state) for c in columns]
                for h in range(heads):
                    weight_pointer = builder.gep(weight_base, [builder.add(builder.mul(intp(h), weight_width),
                                                                           row.index)])
                    weight = _splat(builder, builder.load(weight_pointer), _vf32)
                    for t in range(count):
                        for part in range(2):
                            slot = accumulators[(h * tiles + t) * 2 + part]
                            builder.store(_fma(builder, weight, values[t][part], builder.load(slot)), slot)
            for h in range(heads):
                row_base = builder.gep(acc_base, [builder.mul(intp(h), d)])
                for t in range(count):
                    for part in range(2):
                        index = columns[t] if part == 0 else builder.add(half, columns[t])
                        total = builder.fadd(_load_vector(builder, row_base, index),
                                             builder.load(accumulators[(h * tiles + t) * 2 + part]))
                        _store_vector(builder, total, row_base, index)

        tile_count = builder.udiv(half, intp(LANES))
        groups = builder.udiv(tile_count, intp(tiles))
        with cgutils.for_range(builder, groups) as group:
            tile_group(builder.mul(group.index, intp(tiles)), tiles)
        if tiles > 1:
            with cgutils.for_range(builder, builder.urem(tile_count, intp(tiles))) as rest:
                tile_group(builder.add(builder.mul(groups, intp(tiles)), rest.index), 1)
        return context.get_dummy_value()

    return codegen


def make_int4_scores(heads: int):
    """Intrinsic scores(q, q_row, data, block, offset, head, n, zero_points, scales, out, out_col):

    out[q_row + h, out_col + r] = scales[r] * sum_i q[q_row + h, i] * (code_i(row r) - zero_points[r])
    for h < heads, r < n, row r being data[block, offset + r, head].
    A step takes SCORE_STEPS rows; the last step's extra rows repeat row n - 1
    and write up to 3 columns past out_col + n - 1, which `out` must have.
    """
    codegen = _scores_codegen(INT4_ROWS, heads)

    @intrinsic
    def int4_scores(typingctx, q, q_row, data, block, offset, head, n, zero_points, scales, out, out_col):
        if not (_is_c_array(q, types.float32, 2) and _is_cache(data)
                and _arrays_match((zero_points, scales), INT4_ROWS.score_arrays)
                and _is_c_array(out, types.float32, 2)):
            return None
        return types.void(q, q_row, data, block, offset, head, n, zero_points, scales, out, out_col), codegen

    return int4_scores


def make_int4_accumulate(heads: int):
    """Intrinsic accumulate(acc, acc_row, data, block, offset, head, n, zero_points, weights, weight_row):

    acc[acc_row + h, i] += sum_r weights[weight_row + h, r] * (code_i(row r) - zero_points[r])
    for h < heads, i < d, r < n (codes in storage order, as in make_int4_scores).
    The accumulators hold 4 / heads column tiles of 8 bytes (16 values) per
    head across the row loop; a last group of fewer tiles runs one tile at a time.
    """
    codegen = _accumulate_codegen(INT4_ROWS, heads)

    @intrinsic
    def int4_accumulate(typingctx, acc, acc_row, data, block, offset, head, n, zero_points, weights, weight_row):
        if not (_is_c_array(acc, types.float32, 2) and _is_cache(data)
                and _arrays_match((zero_points,), INT4_ROWS.accumulate_arrays)
                and _is_c_array(weights, types.float32, 2)):
            return None
        return types.void(acc, acc_row, data, block, offset, head, n, zero_points, weights, weight_row), codegen

    return int4_accumulate


def make_half_float_scores(row_kind, heads: int):
    """Intrinsic scores(q, q_row, data, block, offset, head, n, out, out_col) for
    row_kind FLOAT16_ROWS or BFLOAT16_ROWS (data: their bits, a uint16 cache):

    out[q_row + h, out_col + r] = sum_i q[q_row + h, i] * value_i(row r)
    for h < heads, r < n, row r being data[block, offset + r, head]; the last
    step may write up to 3 columns past out_col + n - 1, as in make_int4_scores.
    """
    codegen = _scores_codegen(row_kind, heads)

    @intrinsic
    def half_float_scores(typingctx, q, q_row, data, block, offset, head, n, out, out_col):
        if not (_is_c_array(q, types.float32, 2) and _is_cache(data) and _is_c_array(out, types.float32, 2)):
            return None
        return types.void(q, q_row, data, block, offset, head, n, out, out_col), codegen

    return half_float_scores


def make_half_float_accumulate(row_kind, heads: int):
    """Intrinsic accumulate(acc, acc_row, data, block, offset, head, n, weights, weight_row, weight_col)
    for row_kind FLOAT16_ROWS or BFLOAT16_ROWS:

    acc[acc_row + h, i] += sum_r weights[weight_row + h, weight_col + r] * value_i(row r)
    for h < heads, i < d, r < n: the weights can be the probabilities themselves
    (no scales to fold in). Tiles as in make_int4_accumulate: 4 / heads tiles of
    16 values per head.
    """
    codegen = _accumulate_codegen(row_kind, heads)

    @intrinsic
    def half_float_accumulate(typingctx, acc, acc_row, data, block, offset, head, n, weights, weight_row,
                              weight_col):
        if not (_is_c_array(acc, types.float32, 2) and _is_cache(data) and _is_c_array(weights, types.float32, 2)):
            return None
        return types.void(acc, acc_row, data, block, offset, head, n, weights, weight_row, weight_col), codegen

    return half_float_accumulate
