"""Self-test quizzes, one per notebook, as data, and a small widget that asks them.

Answer first, then read the explanation: a wrong answer is worth more than a right one,
because the explanation says which part of the notebook to reread.

``QUIZZES[key]`` is a tuple of :class:`Question` for the notebook ``key`` (e.g.
``"02_flash_attention_tile_by_tile"``). :func:`quiz_widget` shows one notebook's
questions with radio buttons and a *Check* button; the widget only displays the data.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

__all__ = ["Question", "QUIZZES", "quiz_widget", "check_answer", "static_quiz_html"]


@dataclass(frozen=True)
class Question:
    """One multiple-choice question.

    ``question`` (str); ``choices`` (tuple of at least 2 distinct str); ``answer`` (int, the
    index of the one right choice); ``explanation`` (str: why, and which part of the notebook
    to reread). Raises ValueError when one of these does not hold.
    """

    question: str
    choices: tuple[str, ...]
    answer: int
    explanation: str

    def __post_init__(self):
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError(f"question must be a non-empty str, got {self.question!r}")
        if not isinstance(self.choices, tuple) or len(self.choices) < 2:
            raise ValueError(f"choices must be a tuple of at least 2 str, got {self.choices!r}")
        if len(set(self.choices)) != len(self.choices) or not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError(f"choices must be distinct non-empty str, got {self.choices!r}")
        if (isinstance(self.answer, bool) or not isinstance(self.answer, int)
                or not 0 <= self.answer < len(self.choices)):
            raise ValueError(f"answer must be an index into the {len(self.choices)} choices, got {self.answer!r}")
        if not isinstance(self.explanation, str) or not self.explanation.strip():
            raise ValueError("explanation must be a non-empty str")


Q = Question

QUIZZES: dict[str, tuple[Question, ...]] = {
    "01_online_softmax": (
        Q("Why does a safe softmax subtract the row maximum before taking exponentials?",
          ("To make the result exact instead of approximate",
           "To save floating-point operations",
           "So that every exponent is <= 0 and exp cannot overflow; the result is unchanged",
           "Because the softmax is undefined for positive scores"),
          2,
          "Subtracting the same number from every score changes nothing (the factor e^-c cancels between "
          "top and bottom), and subtracting the maximum makes every exponent <= 0, so exp cannot overflow "
          "and the largest term is exactly 1. Reread section 1, 'Why the maximum is subtracted'."),
        Q("A new tile raises the running maximum from m_old to m_new. What must happen to the running sum l?",
          ("Multiply it by exp(m_old - m_new) before adding the tile's terms",
           "Nothing: the old terms are still right",
           "Multiply it by exp(m_new - m_old)",
           "Reset it to zero and start again"),
          0,
          "Every term already in l was measured against the old maximum; against the new one each is "
          "e^(x - m_new) = e^(x - m_old) * e^(m_old - m_new). One multiplication by alpha = "
          "exp(m_old - m_new) <= 1 corrects all of them. Reread section 3, 'The online update'."),
        Q("How many sweeps over the scores does the online softmax need to write normalised probabilities "
          "(without fusing with V)?",
          ("One", "One per tile", "Three", "Two"),
          3,
          "One sweep keeps the running max and sum, a second writes exp(x - m) / l; the safe softmax needs "
          "three. Only when the probabilities are consumed at once (fused with V) does a single sweep "
          "suffice. Reread sections 2 to 4."),
        Q("A row's scores are all -inf (it may see no key). What should the online softmax give?",
          ("NaN, because the softmax is undefined",
           "m = -inf, l = 0 and an all-zero output, never NaN",
           "Uniform weights 1/N",
           "m = 0 and l = 1"),
          1,
          "The convention of this series and of FlashAttention-2 is zeros, never NaN. A careless update "
          "computes exp(-inf - -inf) = NaN on the first fully masked tile. Reread section 5, "
          "'A row that sees nothing'."),
    ),
    "02_flash_attention_tile_by_tile": (
        Q("What does FlashAttention actually reduce?",
          ("The number of FLOPs: it skips most of the arithmetic",
           "The number of keys each query attends to",
           "The accuracy needed: it is a fast approximation of softmax attention",
           "Memory traffic (HBM reads and writes) and the O(N^2) memory of the score matrix, not the FLOPs"),
          3,
          "Every score, every exponential and every p * v is still computed once, as in the textbook "
          "version. What disappears is the N x N score matrix in HBM and the traffic to and from it: memory "
          "drops from O(N^2) to O(N), and the 2-4x speed-ups come from the avoided round trips. The result "
          "is exact, up to floating-point rounding. Reread section 5, 'What it does not do, and what it "
          "unlocks' (and notebook 05 for the byte counts)."),
        Q("Which state does each query row carry from one key tile to the next?",
          ("(m, l, o): running max, running sum of exp(s - m), unnormalised output",
           "Its whole row of scores",
           "The softmax probabilities of the keys seen so far",
           "Only the running max m"),
          0,
          "Three things' worth of state per row: m, l and the vector o (not yet divided by l). The scores of "
          "a tile are dropped once it is absorbed. Reread section 2, 'The recurrence'."),
        Q("After absorbing t of T key tiles (t < T), what is o / l for a row?",
          ("The final output already",
           "Meaningless until the last tile",
           "The exact softmax-weighted mean of the values over the keys seen so far",
           "An upper bound on the final output"),
          2,
          "It is a perfectly good softmax over the keys seen so far, which is not the answer we want: the "
          "loop can never stop early. Reread section 3, 'Step through it', and the check 'Wrong at every "
          "step before the last' in section 4."),
        Q("What changes if you set keys per tile to 1?",
          ("The loop breaks: a tile must hold several keys",
           "Nothing in the output; the running max moves more often, so there are more rescales",
           "The output becomes an approximation",
           "There are fewer rescales"),
          1,
          "The tile size only decides how many keys fit in fast memory at once. Any tile size gives the same "
          "output up to rounding; smaller tiles rescale more often. Reread section 4, 'The claims, checked'."),
    ),
    "03_query_blocks_and_causal": (
        Q("With Nq = 2 queries and Nk = 5 keys, which keys does query 0 see under FlashAttention-2's causal mask?",
          ("Keys 0 to 3",
           "Key 0 only",
           "All five keys",
           "None"),
          0,
          "The mask is aligned bottom-right: the last query is the newest token and sees every key, so query "
          "i sees keys j <= i + Nk - Nq = i + 3 (query and key positions are indices from 0). 'Key 0 only' is "
          "the top-left rule j <= i, right only when Nq == Nk. Reread section 2, 'Bottom-right alignment'."),
        Q("A row meets a fully masked key tile while its m is still -inf, and the update is written literally. "
          "What happens?",
          ("Nothing: the tile adds zero",
           "The row is skipped automatically",
           "An overflow to +inf",
           "exp(-inf - -inf) = NaN, and the NaN stays in (m, l, o) for every later tile"),
          3,
          "m_new is still -inf, so alpha = exp(-inf - -inf) = NaN, and NaN * 0 is still NaN. The fix is to "
          "subtract 0 instead of m_new while it is -inf (or start from a large finite negative number). "
          "Reread section 5, 'The NaN trap'."),
        Q("Why is a causal tiled loop cheaper than a full one?",
          ("Masked scores are cheaper to exponentiate",
           "The softmax of a causal row needs no maximum",
           "Key tiles wholly above the diagonal are skipped: never loaded, never computed",
           "Causal attention has a shorter output"),
          2,
          "For N x N in T x T tiles, T(T-1)/2 tiles lie above the diagonal and are skipped, close to half; "
          "the diagonal tiles are computed in full and partly thrown away. Reread section 3, 'How much a "
          "causal mask saves'."),
    ),
    "04_backward_pass": (
        Q("What does the FlashAttention backward keep from the forward pass?",
          ("The probabilities P, tile by tile",
           "The output O and one number per query row, the log-sum-exp L = m + log(l)",
           "Nothing: it runs the whole forward again first",
           "The running max m and the running sum l of every tile"),
          1,
          "P_ij = exp(S_ij - L_i): L holds both the row maximum and the row sum, so each tile of P is "
          "recomputed from a tile of S in one pass, and O gives D = rowsum(dO * O). Reread section 2, "
          "'What the forward keeps: O and L'."),
        Q("Why is D_i = sum_j P_ij dP_ij computed as the dot product of dO_i with O_i?",
          ("It is an approximation that is good enough for training",
           "Because dP is symmetric",
           "Because sum_j P_ij (dO_i . V_j) = dO_i . sum_j P_ij V_j = dO_i . O_i: exact, and it needs no row of P",
           "To avoid a division by l"),
          2,
          "dP_ij = dO_i . V_j, so the sum over j pulls dO_i out and leaves sum_j P_ij V_j, which is the "
          "output row O_i the forward already wrote. Reread section 2, 'What the forward keeps: O and L'."),
        Q("In the FlashAttention-2 backward the outer loop runs over key blocks. Which gradient is read and "
          "written back to HBM once per key block?",
          ("dK", "dV", "dQ", "None: all three are written once"),
          2,
          "dK_j and dV_j sum over all query rows, so with the key block fixed they accumulate on chip and are "
          "written once; dQ_i sums over all keys, so each key block adds its share to dQ_i in HBM. Reread "
          "section 3, 'The loop: key blocks outside, query blocks inside'."),
        Q("How many N x N x d matrix products does the flash backward do, compared with the forward's two?",
          ("Five: S is recomputed, then dV, dP, dQ, dK (2.5 times the forward)",
           "Four, the same as the textbook backward",
           "Two, the same as the forward",
           "Eight: everything is done twice"),
          0,
          "The textbook backward reads P and does four products (dV, dP, dQ, dK); recomputing S adds a fifth. "
          "It is 2.5 times the forward's FLOPs and still moves far fewer bytes. Reread section 5, "
          "'What recomputation costs, and what it saves'."),
        Q("Halfway through the backward loop, how far is the running dQ from the textbook dQ?",
          ("Already exact: each dQ_i is finished when its query block is first visited",
           "Exact to rounding for every row",
           "Off by a factor of scale",
           "Still far off: each row of dQ is a sum over every key block, finished only at the last one it sees"),
          3,
          "dQ_i collects scale * dS K_j from every key block, and the key blocks are the outer loop, so a row "
          "of dQ is complete only after the last key block its rows can see. Reread section 4, "
          "'Stepping through the backward'."),
    ),
    "05_io_awareness": (
        Q("Textbook attention and FlashAttention do the same FLOPs. Why is FlashAttention faster on a GPU?",
          ("It uses cheaper instructions for the exponentials",
           "It moves far fewer bytes between HBM and on-chip SRAM, and attention is memory-bound",
           "It skips the small scores",
           "It computes the softmax in lower precision"),
          1,
          "The textbook kernel writes the N x N scores to HBM and reads them back, the probabilities too: "
          "the score matrix crosses the bus four times. The tiled kernel keeps each tile on chip. Reread "
          "sections 2 and 3, the byte counts, and section 5, 'The roofline'."),
        Q("Measured peak memory grows with slope about 2 (textbook) and about 1 (flash) on a log-log plot. "
          "Why is the flash slope a little below 1 at small N?",
          ("Measurement noise",
           "Flash keeps part of the score matrix",
           "The flash output shrinks as N grows",
           "A constant working set (one block_q x tile step) is still a large part of the total"),
          3,
          "Flash's peak is the (N, d) output, linear in N, plus a constant: the arrays of one 64 x 64 step. "
          "At small N the constant weighs a lot and flattens the fitted slope. Reread section 4, "
          "'Peak memory, measured'."),
        Q("On the roofline of a GPU, where does textbook attention in bf16 sit?",
          ("Above the ridge: compute-bound",
           "Exactly at the ridge point",
           "On the bandwidth slope: memory-bound, at any sequence length",
           "Compute-bound for long sequences only"),
          2,
          "Its arithmetic intensity is about d divided by the element size, whatever N is, far below the "
          "bf16 ridge of about 206 FLOP/byte. Reread section 5, 'The roofline'."),
    ),
    "06_kernel_ladder": (
        Q("The scalar CUDA-core kernel moves far fewer HBM bytes than naive attention, yet at d = 128 it "
          "was slower on the H200. What held it back?",
          ("It read S back from HBM",
           "One shared-memory load for every FMA: the shared-memory pipe, not HBM, was the limit",
           "It ran out of registers and spilled",
           "Its exponentials were computed in float64"),
          1,
          "Nsight Compute found the L1/shared pipe 94% busy: each FMA of Q K^T waited for its own 4-byte "
          "shared load. Saving HBM bytes only helps a kernel whose limit is HBM. Reread 'The "
          "register-tiled rung, run on the CPU'."),
        Q("What does the register-tiled rung change, and what should it buy?",
          ("Each thread owns a small block of S and O, so one shared load feeds several FMAs",
           "It stores P in HBM to save registers",
           "It uses tensor cores for Q K^T",
           "It skips the rescaling by alpha"),
          0,
          "Same fold, same bytes from HBM; what changes is the ratio of shared loads to FMAs (1/8 at "
          "d = 64 instead of 1). Reread the register-tiled row of 'The rungs' (its predicted effect) and "
          "'The register-tiled rung, run on the CPU'."),
        Q("At d = 128 the plain register-tiled kernel gives a thread 2 rows x 4 keys of S. Why not simply 8 rows, "
          "and how does the wide build get there?",
          ("8 rows would need more shared memory than a block may have on any GPU; the wide build keeps Q in "
           "registers instead of shared memory, which frees the room",
           "Causal masking needs a thread's rows to lie within 2 of the diagonal; the wide build masks whole "
           "tiles instead, so its rows may be further apart",
           "A thread's FMAs can only feed 2 rows at a time from one shared load; the wide build reads each "
           "value of K twice as often so that more rows can use it",
           "With 8 lanes per row a thread keeps 16 columns of each of its output rows, so 8 rows would be 128 "
           "floats of o alone; 16 lanes per row halve that, and 8 rows x 4 keys fit in 208 registers at d = 128"),
          3,
          "A thread's o is its rows times its share of the head dim, and that share is d / lanes: 128 / 8 = 16 "
          "columns. With 16 lanes it is 8, so 8 rows cost 64 floats of o, and each 4 columns of S need 8 + 4 "
          "loads for 128 FMAs instead of 2 + 4 for 32. The price is shared memory (64 x 64 tiles: 83 KiB, 2 blocks "
          "per SM instead of 4), so whether it is faster is for a GPU run to say. Reread 'Wider rows: 8 rows x 4 "
          "keys per thread'."),
        Q("In SASS, the scalar rung's S loop at d = 64 is 71 instructions: 32 FFMA, 34 shared loads and 5 others. "
          "Each SM quarter issues one warp instruction per clock and finishes one warp FFMA per clock. What does "
          "that say about the rung's speed?",
          ("Nothing: loads run on another unit, so they cost no FFMA any time",
           "The loop is bound by HBM, since every load goes to HBM",
           "In that loop the FP32 lanes are busy at most 32 / 71 = 45% of the clocks, so S = Q K^T runs at most "
           "at about 45% of the FP32 peak, however well the loads are hidden",
           "It runs at 32 / 34 of the peak, the ratio of FFMA to loads"),
          2,
          "A load issues from the same scheduler as the FFMA, so each clock spent issuing it is a clock with no "
          "FFMA issued. Hiding a load's latency does not give its issue slot back. The loads here read shared "
          "memory, not HBM. Register tiling raises the share of FFMA (76% in the plain build at d = 64, 88% in "
          "the wide one), and that share times the FP32 peak is the ceiling the loops allow. Reread 'What the SM "
          "issues: the product loops in machine code'."),
        Q("A warp skips o *= alpha for all 16 of its rows at a key tile and leaves everything else as the FA-2 "
          "rung does. When is its output still bitwise the FA-2 rung's?",
          ("Whenever alpha is close to 1, as it is after the first few tiles",
           "When every row's max grew by less than a small threshold",
           "When no row of the warp raised its running max at that tile",
           "When at least half of the warp's rows kept their max"),
          2,
          "Where a row's max did not move, m_new = m_old, so alpha = exp(0) = 1 (the kernel writes exactly 1) "
          "and o * 1 is o, bit for bit; a row that has seen no key yet has o = 0 either way. The warp votes: "
          "one row that moved makes all 16 rescale, and for its other rows alpha is 1, so that changes nothing. "
          "Close to 1 is not 1: a row whose max grew, even a little, would keep o weighted against its old max "
          "while l and the new P use the new one. A threshold works only when the row also keeps its old max for "
          "P and l until it rescales, so that the stale max cancels in o / l (FlashAttention-4); the result is "
          "then right but not bitwise the eager kernel's. Reread 'Rescaling only when the max moves'."),
        Q("The wide rung gives each warp 32 query rows (two m-tiles) instead of 16. What does that buy, and what "
          "does it cost?",
          ("Each K and V fragment loaded from shared memory feeds both m-tiles' products, so fewer shared-memory "
           "bytes per product; o and s double in registers, so Q's fragments move out to shared memory",
           "K and V are read from HBM twice as often, in exchange for fewer warps",
           "Q K^T needs half the FLOPs",
           "A block no longer needs the causal mask"),
          0,
          "The products per warp double while the K and V loads stay: at d = 64, 160 bytes per product instead "
          "of 256 (Q's loads included), so shared-memory reads alone would allow 80% of the tensor-core peak "
          "instead of 50%. HBM traffic is unchanged: a block still has 128 rows and reads each K and V tile "
          "once. The price is registers: 128 floats of o per thread at d = 128. Reread 'Two m-tiles per warp: "
          "FlashAttention-2's warp shape'."),
        Q("On an interior key tile at d = 64 a warp of the wide rung issues 982 instructions for its 128 HMMA; the "
          "lean build issues 760 for the same 128. One scheduler issues one instruction per clock, and at the tensor "
          "peak its tensor core finishes one HMMA every 4 clocks. What follows?",
          ("The lean build will run 982 / 760 = 1.29x faster than the wide one",
           "The lean build is slower: its pre-pass reads V from HBM once more",
           "Both run at the tensor peak: they issue the same HMMA",
           "The most either can reach rises from 4 x 128 / 982 = 52% to 4 x 128 / 760 = 67% of the tensor peak; how "
           "fast each really runs is for a GPU to say"),
          3,
          "Issue slots bound the rate from above: a warp that issues I instructions per HMMA cannot keep its tensor "
          "core busy more than 4 / I of the clocks, however well it hides latency. Waits at barriers and for copies, "
          "and mma.sync's own rate on Hopper, can hold either build below its ceiling, so the ratio of the counts is "
          "not a forecast. The pre-pass adds one read of V to the 64 reads of K and V that 128-row query blocks make "
          "at N = 8192: under 1% of the bytes. Reread 'Interior tiles that issue only what they need'."),
        Q("On the recorded H200 run, what became of the ladder's targets for our own kernels?",
          ("All were met once the FA-2 recipe was in",
           "The 2-4x claim over naive attention holds (about 20x and 12x), but the 3x (register tiling), "
           "0.5x SDPA and 70% decode targets were all missed (the Hopper target is not yet measured)",
           "Nothing was faster than naive CuPy",
           "No rung has been timed on a GPU yet"),
          1,
          "Every rung up to the FA-2 recipe was timed on 2026-12-01: the FA-2 recipe rung is 20x / 12x naive "
          "CuPy, but register tiling reached 2.7x / 1.4x (aim 3x), the FA-2 rung 0.43x / 0.30x SDPA (aim 0.5x) "
          "and the split decode kernel 51-68% of the copy rate (aim 70%); the rungs built later (the wide "
          "register-tiled rung, the lazy and wide FA-2 rungs, the three Hopper rungs, the prefetch and cp.async decode "
          "builds) "
          "are not yet timed. "
          "Reread 'The targets, met or not'."),
    ),
    "07_paged_attention": (
        Q("What is the one difference between the paged loop and the flash loop?",
          ("Each tile's keys are fetched through the block table: page = block_table[j]",
           "A different softmax",
           "The tiles must be processed in page order",
           "The state is reset at every page"),
          0,
          "A page is just a tile: the fold, the rescales and the output are the same; only the address of "
          "each tile comes from a table look-up. Reread section 2, 'The loop: the flash loop with one look-up'."),
        Q("seq_len = 10 and block_size = 4. How many pages does the loop read, and how many slots of the last?",
          ("2 pages, all 4 slots", "3 pages, 2 slots of the last", "3 pages, all 4 slots of the last",
           "2 pages, 2 slots of the last"),
          1,
          "ceil(10 / 4) = 3 pages; the last holds n = 10 - 2 * 4 = 2 valid slots, and the 2 slots after them "
          "are never read. Reread section 2 (the line n = min(block_size, seq_len - j * block_size)) and "
          "section 1 on the partly filled last page."),
        Q("Why not read the whole last page and zero the slots past seq_len instead?",
          ("Zeros would overflow exp",
           "It makes lse = +inf",
           "It would be slower but give the same output",
           "A zero key still scores 0 and gets weight exp(0 - m): the output changes"),
          3,
          "Padding is not masking: a zero key is a key. Past seq_len the page holds stale data (even NaN), "
          "and the loop must not let any of it into the softmax. Reread section 4, 'The claims, checked' "
          "(the paragraph 'Nothing past seq_len is read')."),
    ),
    "08_flash_decoding_and_ring": (
        Q("Why does flash-decoding split the keys over workers rather than the queries?",
          ("At decode time there is one query per sequence, so too few query blocks to keep the GPU busy",
           "The keys are smaller than the queries",
           "Splitting the queries would not be exact",
           "To save memory"),
          0,
          "With batch 1 and one query, parallelising over query blocks gives only as many thread blocks as "
          "heads. Splitting the keys gives every streaming multiprocessor work, and a short merge at the "
          "end. Reread section 2, 'Flash-decoding: split the keys, merge the partials'."),
        Q("A worker got no keys. Which partial state should it write in the normalised (o, lse) form?",
          ("o = 0, lse = +inf", "o = NaN, lse = NaN", "o = 0, lse = -inf",
           "Nothing: the merge must skip it"),
          2,
          "Zero mass: lse = -inf. It is the identity of the merge, and two empty states merge to an empty "
          "one, provided exp(-inf - -inf) is guarded. Reread section 1, the paragraph 'The empty state'."),
        Q("Does the order in which the partial states are merged change the result?",
          ("Yes: they must be merged left to right",
           "No: the merge is associative and commutative, so any order agrees up to rounding",
           "Only with a causal mask",
           "Yes: a tree reduction is an approximation"),
          1,
          "A left fold (one loop) and a tree (log2 rounds, as a GPU reduction does) give the same output up "
          "to rounding. Reread section 2, 'Flash-decoding: split the keys, merge the partials' (the "
          "paragraph 'Any merge order gives the same output')."),
        Q("Ring attention can pass the key/value blocks around the ring (Liu et al.), or pass each query "
          "block together with its state (m, l, o) while the key/value blocks stay. Which is right?",
          ("Only the key/value blocks may travel: moving the state changes the output",
           "Either may travel: both give the same output up to rounding",
           "Only the query block with its state may travel",
           "Neither: every device needs all the keys at once"),
          1,
          "Either way every query block's state absorbs every KV block exactly once, only in a different order, "
          "and the fold does not care where its tiles come from. What differs is what crosses the link each "
          "step: a KV block, rows x (d + dv) numbers, or a query block and its state, rows x (d + 2 + dv), plus "
          "one last send that returns each finished state to its owner; and only the KV schedule can overlap "
          "the transfer with the fold. Reread section 3, 'Ring attention: two ways round the ring'."),
    ),
    "09_paged_gqa_decode": (
        Q("num_heads = 8 query heads share num_kv_heads = 2 KV heads. Which KV head does query head 3 read?",
          ("KV head 0",
           "KV head 1",
           "Both KV heads",
           "KV head 3"),
          0,
          "The query heads are cut into consecutive groups of num_heads // num_kv_heads = 4: heads 0-3 form KV "
          "head 0's group, so head h reads KV head h // 4 = 3 // 4 = 0 (heads and KV heads are indices from 0). "
          "KV head 1 would be h % num_kv_heads, as if heads alternated. Reread section 2, 'Which KV head does a "
          "query head read?'."),
        Q("Why share key/value heads at all?",
          ("It makes the softmax faster",
           "It removes the need for a block table",
           "It improves accuracy",
           "It shrinks the KV cache, and the bytes each decode step reads, by num_heads / num_kv_heads"),
          3,
          "The cache grows with num_kv_heads, and a decode step is bandwidth-bound: reading a cache four "
          "times smaller is four times faster. Reread section 1, 'Why share key/value heads'."),
        Q("In the decode loop, how often is a page of one KV head loaded for its group of query heads?",
          ("Once per query head", "Once: every head of the group uses the same load", "Once per token",
           "Never: it stays in SRAM between steps"),
          1,
          "The group's query heads are the rows of one small matrix product against the page, so the page is "
          "loaded once and used num_heads / num_kv_heads times. Reread section 3, 'The loop', and section 5."),
    ),
    "10_decode_kernel_ladder": (
        Q("On the recorded H200 run one block of the first decode rung (paged_decode) read 0.71 to 0.74 GB/s of "
          "K/V whether 8 or 512 blocks ran. Its SASS asks for one 2-byte value of K and one of V per thread, then "
          "stores them to shared memory at once. What does the flat rate per block say?",
          ("HBM was saturated, so each block got an equal share of it",
           "Each block waits on its own round trips with only 4 bytes per thread in flight; the blocks do not "
           "compete yet, so more blocks read proportionally more",
           "The SM's schedulers were the limit, busy issuing every clock",
           "The K/V came from the L2 cache, whose latency does not depend on the load"),
          1,
          "Little's law: a memory system with B bytes asked for and not yet delivered delivers B / L per second. Each "
          "block keeps 512 bytes in flight and a page takes 16 round trips of at most 0.70 \u00b5s, so 64 times more "
          "blocks read 64 times faster. Had HBM been saturated, or the schedulers full, the rate per block would fall "
          "as blocks were added (about four blocks share an SM at 512); and 0.5-1 GiB of K/V is far larger than the "
          "50 MB L2. To read at the recorded 4.28 TB/s copy rate takes about 3.0 MB in flight, 22 KiB per SM; with 9 "
          "blocks per SM this rung holds 4.5 KiB, so at most 0.87 TB/s (20%), however the keys are split. The split "
          "rung asks for 16 bytes of 4 keys' K and V per lane before it uses any: 16 KiB per block. Reread 'Bytes in "
          "flight: Little's law'."),
        Q("The prefetch decode rung keeps the next step's K/V rows in registers while it absorbs this step's, and "
          "needs 168 registers, so only 3 blocks fit on an SM. The cp.async rung keeps two steps ahead and still "
          "fits 4 blocks with 128 registers. Why?",
          ("cp.async compresses the rows, so they take fewer registers",
           "It waits for every copy at once at the end of the split, so nothing is in flight during a step",
           "It reads each row twice as fast, so it needs half the rows in flight",
           "Its copies go from global straight into a ring in shared memory: the rows in flight hold no "
           "registers, only 48 KiB of shared memory per block, and 4 x 48 KiB fit in an SM's 228 KiB"),
          3,
          "A register load (LDG) must land in registers the warp owns from the moment it asks until it uses them, so "
          "every step in flight costs registers. cp.async (LDGSTS in SASS) writes shared memory instead; the thread "
          "waits later for a whole group of its copies (cp.async.wait_group 2: until at most 2 groups are still on "
          "their way). Each thread reads back only its own pieces, so no barrier is needed. Registers stay at the "
          "split rung's 128 and 4 blocks fit, with 384 bytes per thread in flight at a wait: 192 KiB per SM against "
          "the 22 KiB Little's law asks at the copy rate. Reread 'The decode ladder' and 'Bytes in flight: Little's "
          "law'."),
        Q("At 8 sequences of 32768 tokens the split decode kernel has 64 blocks per split, 2048 pages per sequence, "
          "and an H200 holds a wave of 528 of its blocks at once. Why does the wave model pick 8 splits rather than "
          "the 9 that fill the wave?",
          ("9 splits are 576 blocks: 48 of them run in a second wave that lasts as long as the first, so the "
           "model's time is 2 x 228 pages per block against 1 x 256 for 8 splits in one wave",
           "9 splits would read some pages twice",
           "More splits always cost more, because their partial states must be merged",
           "9 does not divide 2048, so the last split would have no page"),
          0,
          "A wave lasts about as long as one block when every block reads about as many pages, however few blocks it "
          "holds, so time is waves x pages per block (lessons.gpu.source.decode_split_cost). 8 splits leave 16 slots "
          "of the wave idle but finish in one wave; the ninth split spills 48 blocks into a second one and nearly "
          "doubles the time. So the rule is the most splits whose blocks fit in one wave (528 // 64 = 8), never one "
          "more. The recorded run's split kernel ran 9 splits there and read 51% of the copy rate, its "
          "lowest of the three shapes. The merge of partial states is small next to reading 2048 pages, and a split "
          "of 228 pages reads each page once. Reread 'How many splits: waves of blocks'."),
    ),
    "11_hopper_kernels": (
        Q("On an interior key tile of the ping-pong Hopper rung at d = 64 where no row's max moves (so the lazy "
          "rescale computes no alpha), a consumer warp's products keep the tensor cores busy 512 clocks, its 64 MUFU "
          "hold the special function unit 512 clocks, and it issues 493 instructions. What bounds the tile, "
          "whatever the order of its steps?",
          ("The issue slots: 493 instructions against 512 clocks of products",
           "The tensor cores and the exponentials together: no order keeps the tensor cores busy more than "
           "512 / 512 = 100% of the time, and a tile whose max moves, with 2 MUFU more, falls below it",
           "The exponentials alone: the products are done before the last MUFU",
           "Their sum: 512 + 512 + 493 clocks per tile, about a third of the peak"),
          1,
          "The three pipes work side by side, so the longest sets the least time a tile can take: max(512, 512, "
          "493) = 512 clocks, and the tensor cores and the special function unit both need all of them. The sum "
          "would be the time if nothing overlapped; the order of the steps (overlap, turns) is what lets them "
          "overlap. At d = 64 a score costs 4d = 256 FLOPs of products and one exponential, and an SM does 4096 "
          "product FLOPs but only 16 exponentials per clock, so the exponentials alone take as long as the "
          "products (FlashAttention-3, Sec. 3.1). A tile on which a row's max moves also computes the 2 rows' "
          "alpha: 66 MUFU, 528 clocks, at most 512 / 528 = 97% of the peak. Reread 'Three pipes per key tile'."),
        Q("In the Hopper rung, what tells the producer warpgroup that it may copy the next K and V tile into "
          "a shared-memory stage?",
          ("The stage's empty mbarrier completing a phase: all 256 consumer threads arrived on it when they "
           "finished the tile it held",
           "A __syncthreads() of the whole block after every tile",
           "The TMA copy engine waits by itself until nobody reads the stage",
           "Nothing: the producer copies every tile at once, one stage each"),
          0,
          "The consumers arrive on empty[s] when they are done with stage s; the producer waits for that "
          "phase (try_wait.parity) before it issues the copy, whose bytes then complete full[s]; once its warp "
          "has checked V, it arrives on ready[s], on which the consumers wait. A block-wide barrier would make "
          "the producer and the consumers meet at the same point of their different loops, so the producer "
          "could never run a stage ahead; an mbarrier lets one side signal without waiting. "
          "Reread 'The Hopper rung: a producer, two consumers, TMA and wgmma'."),
        Q("TMA writes each K tile swizzled: chunk c of row r lands in slot c XOR (r mod 8) of its 128-byte row. "
          "Why?",
          ("It compresses the tile so that two fit in one stage",
           "It keeps other blocks from reading the tile",
           "A product reads the same 16-byte chunk of 8 rows at once; swizzled, those 8 chunks sit in 8 "
           "different groups of banks, so the read takes one pass instead of eight",
           "TMA cannot write rows one after another"),
          2,
          "Shared memory has 32 banks of 4 bytes; a 128-byte row spans each once. Unswizzled, chunk 2 of rows "
          "0-7 is always bytes 32-47, the same 4 banks, so 8 reads queue up; with the XOR they spread over all "
          "32. The FA-2 rung computed the same layout by hand. Reread the swizzle picture in 'The Hopper rung'."),
        Q("In the rung that overlaps softmax with the products, tile j's softmax writes P_j in float32, and "
          "P_j is rounded into its 16-bit registers only after wgmma.wait_group 0. Why not as soon as the "
          "softmax is done?",
          ("Rounding before the wait would change the output bits",
           "The tensor cores cannot take 16-bit values before wait_group 0",
           "The exponentials of tile j are still running until wait_group 0",
           "Those registers still hold P_{j-1}, which the P_{j-1} V_{j-1} product in flight reads; ptxas "
           "would have to make every product wait for the one before it, and the overlap would be gone"),
          3,
          "wgmma reads its register operand while it runs, not when it is issued. P_{j-1} V_{j-1} runs during "
          "tile j's softmax, so P_{j-1}'s registers must stay untouched until wait_group 0 says it is done; only "
          "then is P_j packed into them. Code that wrote them earlier would make ptxas wait for every product "
          "before the next ('Potential Performance Loss' in its log): the output right, the overlap gone. "
          "Rounding P_j into a second set of registers would be legal, but costs 32 more registers a thread "
          "at d = 64, against a cap of 168. The rounding itself is the plain rung's, so the output stays "
          "bitwise the same. Reread 'Overlapping softmax with the products' (what it costs)."),
        Q("In the ping-pong rung warpgroup 1 arrives once on warpgroup 0's barrier before its first turn. "
          "What happens if it leaves that arrival out?",
          ("Nothing: the barriers only order the issues, so the output is the same",
           "The output changes, because the products run in another order",
           "The two warpgroups issue their products at once, as in the overlapped rung",
           "Warpgroup 0 waits for a first turn nobody gives, and warpgroup 1 waits for warpgroup 0: the "
           "block never finishes"),
          3,
          "A warpgroup issues only after bar.sync on its own barrier has completed, which needs the other's "
          "bar.arrive. Without the first arrival warpgroup 0's first bar.sync never completes, and warpgroup 1 "
          "waits on its own barrier for warpgroup 0: a deadlock (the emulator reports it; a GPU would hang). "
          "Counting alone would not catch it: had warpgroup 1 also made its last arrival, the counts would "
          "come out even and the block would still never finish. Reread 'Taking turns: the two consumers in "
          "ping-pong'."),
        Q("In a tile stored with the 128-byte swizzle, chunk 5 of rows 0 to 7 sits in 8 different 16-byte slots, so "
          "one instruction reads all 8 in one pass. Where do chunk 5 of row 3 and chunk 5 of row 11 sit, and how "
          "many passes does a read of just those two chunks take?",
          ("Both in slot 6: the same 4 banks at two addresses, so two passes",
           "Slots 6 and 14: different banks, so one pass",
           "Both in slot 5: the swizzle moves only rows 0 to 7, and two chunks fit in one pass",
           "Slots 6 and 5: row 11 lies past the 8 rows the swizzle covers, so one pass"),
          0,
          "A 128-byte row has 8 slots of 16 bytes, each one group of 4 of the 32 banks, and every row starts at bank "
          "0. The swizzle stores chunk c of row r at slot c XOR (r mod 8): row 3 gives 5 XOR 3 = 6, and so does row "
          "11, since 11 mod 8 = 3. Rows 8 apart share a layout, so their chunk c shares 4 banks at two different "
          "addresses, and shared memory serves them one after the other: two passes (reading 16 rows at once needs "
          "two passes anyway, 256 bytes through 128 bytes of banks). XOR with the row itself would give slot 14, "
          "past the end of the row. The swizzle only has to spread the 8 consecutive rows that ldmatrix and wgmma "
          "read together. Reread the swizzle picture in 'The Hopper rung: a producer, two consumers, TMA and wgmma' "
          "and the exercise, 'Your turn'."),
    ),
}


def check_answer(question: Question, choice: int | None) -> tuple[bool | None, str]:
    """The feedback for picking choice index ``choice`` (None: nothing picked yet).

    Returns ``(correct, html)``: ``correct`` is None when nothing was picked, and the html
    holds the verdict and, once an answer is given, the explanation.
    """
    if choice is None:
        return None, "<i>Pick an answer first.</i>"
    right = choice == question.answer
    verdict = ("<b>Right.</b>" if right else
               f"<b>Not quite.</b> The answer is: {html.escape(question.choices[question.answer])}.")
    return right, f"{verdict}<br>{html.escape(question.explanation)}"


def static_quiz_html(key: str) -> str:
    """The quiz of notebook ``key`` as static HTML, for pages read without a kernel.

    One numbered question per item, its choices lettered (a), (b), ... (also where a page's style
    sheet letters nested lists otherwise, as JupyterLab's does with A, B, ...), and the answer
    with its explanation behind a collapsible ``<details>`` element ("Show the answer"),
    so a reader can still answer first. All text is HTML-escaped. Returns a str.
    Raises ValueError naming the known keys.
    """
    if key not in QUIZZES:
        raise ValueError(f"key must name a notebook's quiz, got {key!r}; quizzes: {', '.join(QUIZZES)}")
    parts = ["<div class='static-quiz'><h4>Self-test (static version)</h4>"
             "<p><i>Answer first, then open the answer: the explanation says what to reread.</i></p><ol>"]
    for q in QUIZZES[key]:
        choices = "".join(f"<li>{html.escape(c)}</li>" for c in q.choices)
        letter = chr(ord("a") + q.answer)
        parts.append(f"<li><p><b>{html.escape(q.question)}</b></p>"
                     f"<ol type='a' style='list-style-type: lower-alpha'>{choices}</ol>"
                     f"<details><summary>Show the answer</summary><p>({letter}) "
                     f"{html.escape(q.choices[q.answer])}. {html.escape(q.explanation)}</p></details></li>")
    parts.append("</ol></div>")
    return "".join(parts)


def quiz_widget(key: str):
    """An ipywidgets view of the quiz of notebook ``key``: per question, radio buttons, a
    *Check* button and a feedback line that reveals the explanation once answered.

    Returns a ``VBox``; its ``questions`` attribute lists, per question, a dict with the
    ``radio``, ``button`` and ``feedback`` widgets. Raises ValueError naming the known keys.
    """
    import ipywidgets as widgets

    if key not in QUIZZES:
        raise ValueError(f"key must name a notebook's quiz, got {key!r}; quizzes: {', '.join(QUIZZES)}")
    boxes, views = [], []
    for i, q in enumerate(QUIZZES[key], 1):
        title = widgets.HTML(f"<b>{i}. {html.escape(q.question)}</b>")
        radio = widgets.RadioButtons(options=[(c, j) for j, c in enumerate(q.choices)], value=None,
                                     layout=widgets.Layout(width="max-content"))
        button = widgets.Button(description="Check", button_style="info")
        feedback = widgets.HTML("")

        def on_click(_, q=q, radio=radio, feedback=feedback):
            _, text = check_answer(q, radio.value)
            feedback.value = text

        button.on_click(on_click)
        boxes.append(widgets.VBox([title, radio, button, feedback]))
        views.append({"radio": radio, "button": button, "feedback": feedback})
    box = widgets.VBox([widgets.HTML("<h4>Self-test</h4><i>Answer first, then check: the explanation says "
                                     "what to reread.</i>"), *boxes])
    box.questions = views
    return box
