"""Reading offline builds: per-loop spill and instruction counts from hand-made SASS."""

from cs336_kernels.sass import loop_opcodes, loop_spills


def test_loop_spills_counts_innermost_loops_with_wgmma() -> None:
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2 ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0030*/                   LDL R3, [R1] ;
        /*0040*/                   STL [R1+0x4], R3 ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/               @P1 BRA 0x10 ;
        /*0070*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0080*/               @P2 BRA 0x70 ;
        /*0090*/                   BRA 0x20 ;
        /*00a0*/                   EXIT ;
    """
    # The loop at 0x20..0x50 sits inside 0x10..0x60; 0x70..0x80 has no wgmma; the unpredicated branch back
    # from 0x90 is not a loop.
    assert loop_spills(sass) == [[1, 1, 4]]


def test_loop_opcodes_counts_guarded_instructions_of_innermost_loops() -> None:
    sass = """
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0030*/              @!P1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR8+0x385c0], RZ ;
        /*0040*/                   FMUL R2, R2, 0.5 ;
        /*0050*/               @P0 FMUL R3, R3, R2 ;
        /*0060*/               @P0 BRA 0x10 ;
        /*0070*/                   FMUL R4, R4, R4 ;
    """
    # The barrier before the loop and the multiply after it are not counted; guards do not hide an opcode.
    assert loop_opcodes(sass, ("BAR.SYNC", "SYNCS.ARRIVE", "FMUL", "MUFU")) == [
        {"BAR.SYNC": 1, "SYNCS.ARRIVE": 1, "FMUL": 2, "MUFU": 0}]
