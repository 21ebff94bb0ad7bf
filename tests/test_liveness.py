"""The live-value count the Metal cost page reports, on IR small enough to count by hand."""

from __future__ import annotations

from patchkit.verify.emulate.liveness import peak_live_words, words

STRAIGHT = """define float @f(ptr %p) {
  %a = load float, ptr %p, align 4
  %b = load <4 x float>, ptr %p, align 16
  %c = fadd fast float %a, 1.0
  %d = extractelement <4 x float> %b, i64 0
  %e = fadd float %c, %d
  ret float %e
}"""

# x (4 words) is read in every trip: the back edge keeps it live through the loop, beside
# the accumulator and the extracted lane.
LOOP = """define float @g(ptr %p, i32 %n) {
entry:
  %x = load <4 x float>, ptr %p, align 16
  br label %loop

loop:                                             ; preds = %loop, %entry
  %acc = phi float [ 0.0, %entry ], [ %next, %loop ]
  %i = phi i32 [ 0, %entry ], [ %i1, %loop ]
  %s = extractelement <4 x float> %x, i64 0
  %next = fadd float %acc, %s
  %i1 = add i32 %i, 1
  %c = icmp slt i32 %i1, %n
  br i1 %c, label %loop, label %exit

exit:                                             ; preds = %loop
  ret float %next
}"""


def test_a_straight_block_peaks_where_the_vector_and_a_scalar_overlap() -> None:
    # live before %c: a (1) and b (4); before %e only c and d.
    assert peak_live_words(STRAIGHT) == 5


def test_a_loop_keeps_what_the_next_trip_reads() -> None:
    assert peak_live_words(LOOP) == 6
    # Control: the same loop with the lane read once before it keeps x out of the loop.
    hoisted = (
        LOOP.replace(
            "  br label %loop\n", "  %s0 = extractelement <4 x float> %x, i64 0\n  br label %loop\n"
        )
        .replace("  %s = extractelement <4 x float> %x, i64 0\n", "")
        .replace("%acc, %s", "%acc, %s0")
    )
    assert peak_live_words(hoisted) == 4  # x before the extract; in the loop s0 and acc


def test_result_types_by_opcode() -> None:
    assert words("fmul contract <8 x float> %a, %b") == 8
    assert words("fpext half %h to float") == 1
    assert words("load half, ptr %p, align 2") == 0.5
    assert words("tail call float @llvm.fma.f32(float %a, float %b, float %c)") == 1
    assert words("shufflevector <4 x float> %a, <4 x float> poison, <2 x i32> <i32 0, i32 1>") == 2
    assert words("select i1 %c, float %a, float %b") == 1
    assert words("add i32 %a, 1") == 0 and words("fcmp olt float %a, %b") == 0
