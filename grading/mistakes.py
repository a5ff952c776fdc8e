"""The classic mistakes the grader knows by name, with the advice shown for each.

A grading test lists the mistakes its failure points to with
``@pytest.mark.catches("key", ...)``; when it fails, the score card shows
``"<title>: <advice>"`` for each. Every file in ``mutants/`` makes exactly one of
these mistakes, and ``tests/test_grader.py`` proves the grader names it.
"""

MISTAKES = {
    "alpha_missing_on_o": (
        "alpha missing on o",
        "when the running max moves, the accumulated output must be rescaled too: "
        "o = alpha * o + p @ v with alpha = exp(m_old - m_new)"),
    "alpha_missing_on_l": (
        "alpha missing on l",
        "when the running max moves, the running sum must be rescaled: "
        "l = alpha * l + sum(p) with alpha = exp(m_old - m_new)"),
    "no_guard": (
        "no guard on exp(-inf - -inf)",
        "a row whose max is still -inf (fully masked tile, empty split, empty state) gives "
        "exp(-inf - -inf) = NaN; subtract 0 instead of -inf there so the state stays empty "
        "(m = -inf, l = 0, o = 0)"),
    "top_left_causal": (
        "top-left causal mask",
        "causal is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq "
        "(j <= i is only right when Nq == Nk)"),
    "last_partial_tile_dropped": (
        "last partial tile dropped",
        "when N (or seq_len) is not a multiple of the tile (block_size), the last tile is "
        "partial and must still be processed: ceil(N / tile) tiles, not N // tile"),
    "zero_padding_as_mask": (
        "zero padding used as a mask",
        "a zero-filled key still scores 0 and gets weight exp(0 - m); positions past seq_len "
        "must be left out (or scored -inf), not zeroed"),
    "reads_past_seq_len": (
        "reads past seq_len",
        "the slots of the last page past seq_len hold stale data (even NaN): read only the "
        "first n = seq_len - j * block_size slots of logical block j"),
    "lse_inf_for_empty": (
        "lse = +inf for an empty row",
        "an empty state (no keys) is o = 0, lse = -inf: it is the identity of the merge; "
        "+inf would swamp every other partial"),
    "head_modulo": (
        "h % num_kv_heads head mapping",
        "consecutive query heads share a kv head: query head h reads kv head "
        "h // (num_heads // num_kv_heads), not h % num_kv_heads"),
    "scale_1_over_d": (
        "scale 1/d",
        "scores are q . k / sqrt(d): the default scale is 1/sqrt(d), not 1/d"),
    "current_not_peak": (
        "current memory instead of peak",
        "measure the peak during the call (tracemalloc.reset_peak() before, "
        "tracemalloc.get_traced_memory()[1] after), not what is still allocated after it returns"),
    "causal_offset_ignored": (
        "causal mask on local indices",
        "a device's KV block starts at k_start and its queries at q_start: compare global "
        "positions, key k_start + j is visible to query q_start + i iff k_start + j <= q_start + i"),
    "d_left_out": (
        "D left out of dS",
        "softmax's gradient subtracts each row's D_i = dO_i . O_i (= sum_j P_ij dP_ij): "
        "dS = P * (dP - D), not P * dP; without it dQ and dK are wrong, dV is not"),
    "p_not_normalised_by_l": (
        "P not normalised by L",
        "the backward recomputes P_ij = exp(S_ij - L_i) with the forward's log-sum-exp L_i = m_i + log(l_i); "
        "exp(S) alone is neither stable nor normalised (its rows do not sum to 1)"),
    "scale_missing_on_dq": (
        "scale missing on dQ",
        "S = scale * Q K^T, so the chain rule brings the scale back: dQ_i += scale * dS K_j"),
    "scale_missing_on_dk": (
        "scale missing on dK",
        "S = scale * Q K^T, so the chain rule brings the scale back: dK_j += scale * dS^T Q_i"),
    "causal_dropped_in_backward": (
        "causal mask dropped in the backward",
        "the backward must mask exactly what the forward masked: set S to -inf where j > i + Nk - Nq "
        "before P = exp(S - L), or the hidden keys get probability and gradient"),
    "dv_uses_p_not_pt": (
        "dV uses P instead of P^T",
        "dV = P^T dO: key j collects the dO_i of every row i that attended to it, weighted by P_ij; "
        "dV_j += P^T dO_i has shape (block_k, dv)"),
    "tie_counted_as_move": (
        "a tie counted as a move",
        "a max moves only when it strictly grows: a tile whose max equals the row's running max "
        "(-inf = -inf included, a row that has seen no key yet) leaves m as it was and alpha exactly 1; "
        "compare with >, not >="),
    "nan_alpha_counted_as_move": (
        "NaN alpha counted as a move",
        "a row that has seen only masked keys keeps m = -inf, so alpha = exp(m_old - m_new) is "
        "exp(-inf - -inf) = NaN, and NaN != 1 is True; its max did not move. Compare the maxes "
        "(m_new > m_old is False for -inf and -inf), or take alpha = 1 where m_new is still -inf"),
    "one_max_per_block": (
        "one max for the whole block",
        "each row has its own running max and its own alpha: a row whose max grows must rescale even "
        "when another row of the block holds a larger score; take the max per row (axis=1), then ask "
        "whether any row moved"),
    "fractional_waves": (
        "fractional waves",
        "a wave of a few blocks lasts as long as a full one (each block reads its pages however few blocks run "
        "beside it): count whole waves, ceil(num_splits x blocks_per_split / wave); 9 splits of 64 blocks in a "
        "wave of 528 are 576 blocks, 2 waves, not 1.09"),
    "waves_floor_plus_one": (
        "a wave too many when the blocks fill whole waves",
        "num_splits x blocks_per_split // wave + 1 counts one wave too many when the blocks fill whole waves "
        "exactly (66 splits of 8 blocks are 528 blocks: one wave of 528, not 2): count whole waves rounded up, "
        "ceil(blocks / wave), in integers -(-blocks // wave)"),
    "floor_pages_per_block": (
        "pages per block rounded down",
        "the split with the most pages sets how long its blocks read: ceil(pages / num_splits), not "
        "pages // num_splits nor the fraction pages / num_splits (2048 pages in 9 splits: some splits hold 228)"),
    "fewest_splits_filling_the_wave": (
        "the fewest splits that fill a wave",
        "ceil(wave / blocks_per_split) splits can spill a few blocks into a second wave that lasts as long as the "
        "first (8 x 32768 tokens: 9 splits are 576 blocks, 48 of them in a second wave; wave_time 2 x 228 = 456 "
        "against 1 x 256 for 8): take the most splits whose blocks fit in one wave, wave // blocks_per_split"),
    "splits_not_capped_at_pages": (
        "more splits than pages",
        "a split of no page does nothing: at most pages splits (1 x 100 tokens in pages of 16 is 7 pages, so at "
        "most 7 splits, though 66 would fit in the wave)"),
    "zero_splits": (
        "0 splits for a grid wider than a wave",
        "when one split already has more blocks than a wave, wave // blocks_per_split is 0: a launch has at least "
        "1 split (its blocks run in several waves as they are)"),
    "no_swizzle": (
        "no swizzle",
        "stored row after row (slot = chunk), chunk c of the 8 rows ldmatrix and wgmma read at once sits in one slot, "
        "the same 4 banks at 8 addresses: 8 passes. The 128-byte swizzle stores chunk c of row r at slot "
        "c XOR (r % 8), 8 different slots, one pass"),
    "row_not_mod_8": (
        "XOR with the row, not row % 8",
        "a 128-byte row has only 8 slots of 16 bytes: chunk XOR row leaves them from row 8 on (row 9, chunk 2: slot "
        "11). XOR with row % 8: rows 8 apart share a layout, and rows 0 and 8 read together take 2 passes"),
    "xor_on_bytes": (
        "XOR on the byte, not the chunk",
        "the swizzle moves whole 16-byte chunks: XOR the chunk index col // 8 with row % 8 and keep the 8 values of "
        "the chunk in order, 128 x row + 16 x (col // 8 XOR row % 8) + 2 x (col % 8); XORing the byte offset "
        "2 x col moves values inside their chunk and leaves every chunk in the same banks"),
    "rotation_not_xor": (
        "a rotation, not an XOR",
        "(chunk + row) % 8 also gives 8 consecutive rows 8 different slots, but it is not the layout TMA writes and "
        "the wgmma descriptor names: the 128-byte swizzle flips the bits of the chunk index where row % 8 has a 1, "
        "chunk XOR (row % 8) (chunk 2 of rows 0 .. 7: slots 2, 3, 0, 1, 6, 7, 4, 5, not 2, 3, 4, 5, 6, 7, 0, 1)"),
    "row_div_8": (
        "XOR with row // 8, not row % 8",
        "row // 8 is which group of 8 rows a row is in, the same for rows 0 .. 7, so the 8 rows ldmatrix and wgmma "
        "read at once keep their chunk in one slot (8 passes); XOR with row % 8, the row's place in its group of 8"),
    "four_byte_values": (
        "4 bytes per value",
        "the tile holds 16-bit values, 2 bytes each: 8 fill a 16-byte chunk and 64 a 128-byte row, so value col % 8 "
        "of its chunk is 2 x (col % 8) bytes in, and its chunk is col // 8: "
        "128 x row + 16 x swizzle_128b(row, col // 8) + 2 x (col % 8)"),
    "distinct_slots": (
        "the slots used, not the fullest slot",
        "read_passes counts the passes: the chunks in the fullest slot (the same 4 banks at different addresses, "
        "one after another), not how many different slots the rows use. Rows 0 .. 7 use 8 slots, one chunk each: 1 "
        "pass; rows 0 and 8 share slot 2: 2 passes. Count swizzle_128b(r, chunk) over the rows and take the largest "
        "count"),
}


def hint_text(key: str) -> str:
    """``"<title>: <advice>"`` for a mistake key; KeyError names the known keys."""
    if key not in MISTAKES:
        raise KeyError(f"unknown mistake {key!r}; known: {', '.join(MISTAKES)}")
    title, advice = MISTAKES[key]
    return f"{title}: {advice}"
