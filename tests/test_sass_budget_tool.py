"""tools/sass_budget.py on a synthetic listing (the real kernels: tests/test_kernel_build.py)."""

import pytest
from repo_tools import load_tool

# Block 0's turn, then one loop iteration: its turn (Q K^T), a branch over the mask, the softmax, a
# branch over a rescale, and the next iteration's turn; cuobjdump's layout of address and instruction.
LISTING = """
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING R0, 0x100 ;
        /*0010*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0030*/                   BAR.ARV R3, 0x100 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING R0, 0x100 ;
        /*0050*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT ;
        /*0060*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0070*/                   QGMMA.64x136x32.F32.E4M3.E4M3 R120, R8, gdesc[UR8], R120, gsb0 ;
        /*0080*/               @P0 BRA 0x1c0 ;
{mask}
        /*01c0*/                   FMNMX R4, R24, R25, !PT ;
        /*01d0*/                   FFMA.SAT R24, R24, R5, R6 ;
        /*01e0*/                   IMAD R9, R24, 0x100, R25 ;
        /*01f0*/              @!P1 BRA 0x{after_rescale:x} ;
{rescale}
        /*{after_rescale:04x}*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*{next_turn:04x}*/                   BAR.SYNC.DEFER_BLOCKING R0, 0x100 ;
        /*{next_qk:04x}*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT ;
"""


def listing():
    mask = "\n".join(f"        /*{0x90 + 16 * i:04x}*/                   FSEL R{24 + i}, R{24 + i}, -INF , !P2 ;"
                     for i in range(19))
    rescale_start = 0x200
    rescale = "\n".join(f"        /*{rescale_start + 16 * i:04x}*/                   FMUL R{120 + i}, R{120 + i}, R7 ;"
                        for i in range(20))
    after = rescale_start + 16 * 20
    return LISTING.format(mask=mask, rescale=rescale, after_rescale=after, next_turn=after + 16, next_qk=after + 32)


@pytest.fixture(scope="module")
def tool():
    return load_tool("sass_budget")


def test_the_walk_takes_one_iteration_on_its_common_path(tool):
    path = tool.common_iteration(tool.parse(listing()), "QGMMA.64x128x32")
    ops = [i.opcode for i in path]
    # From the second turn's barrier to the instruction before the third turn: the mask's FSELs and the
    # rescale's FMULs are skipped, the softmax's three instructions kept.
    assert path[0].address == 0x40 and ops[0] == "BAR.SYNC.DEFER_BLOCKING"
    assert ops.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 2 and "FSEL" not in ops and "FMUL" not in ops
    assert ["FMNMX", "FFMA.SAT", "IMAD"] == [op for op in ops if op in ("FMNMX", "FFMA.SAT", "IMAD")]
    assert ops[-1] == "UIADD3"


def test_the_budget_counts_pipes_and_the_tensor_time(tool):
    path = tool.common_iteration(tool.parse(listing()), "QGMMA.64x128x32")
    result = tool.budget(path, 128)
    assert result["counts"]["fma"] == 1 and result["counts"]["imad"] == 1 and result["counts"]["alu"] == 1
    assert result["tensor_cycles"] == 1056  # two consumers' 64x128x128 Q K^T and 64x136x128 P V at 8192
    assert result["pipe_cycles"]["fma"] == pytest.approx(8 * 32 / 117)
    assert tool.budget(path, 128, dtype="bf16")["tensor_cycles"] == 2048


def test_a_listing_without_a_loop_is_refused(tool):
    with pytest.raises(ValueError, match="fewer than two"):
        tool.common_iteration(tool.parse(listing().split("/*0040*/")[0]), "QGMMA.64x128x32")
