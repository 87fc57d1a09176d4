#!/usr/bin/env python3
"""Checks the SASS of sm_90a kernels for one compiler fault: a register that a loop's wgmma
(HGMMA) reads as its A operand, holding a value that must survive to the next iteration, reused
for something else inside the loop.

Seen with ptxas of CUDA 13.0 in dkv_tf32_sm90_kernel: the K fragments (defined before the tile
loop, read by every iteration's S^T = K Q^T) had their registers handed to the softmax's loads and
to P^T's fragments inside the loop, so from the second tile on S^T read P^T (docs/ALGORITHM.md,
"float32 backward in tf32 mode on sm_90a"; the kernels work around it with keep_live_in_loop).

Rule, per loop (a backward branch) and per register r that an HGMMA in the loop reads as A before
any write to r in the loop body (so the value comes from before the loop or from the previous
iteration): after the last write to r in the body, nothing else in the body may read r. A value
meant for the next iteration's HGMMA is written last and read by nothing else (P fragments of the
forward, or the XOR that keep_live_in_loop adds); the fault shows as a last write that something
else in the loop still reads (P^T's fragment, read by the dV product), or as the value itself
being consumed in the loop.

usage: check-sass-wgmma.py SASS_FILE...   (cuobjdump -sass output; exit 1 on a finding)
       check-sass-wgmma.py --self-test    (the rule on two miniature kernels; run by CTest)
"""
import re
import sys

INS = re.compile(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;')
FUNC = re.compile(r'\s*Function : (\S+)')
REG = re.compile(r'\bR(\d+)\b')


def width(op):
    if '.128' in op:
        return 4
    if '.64' in op or '.WIDE' in op:
        return 2
    return 1


def parse(ins):
    """-> (opcode, written registers, read registers) of one SASS instruction."""
    ins = re.sub(r'^@!?U?P[T0-9]+\s+', '', ins)
    parts = ins.split(None, 1)
    op = parts[0]
    ops = [o.strip() for o in parts[1].split(',')] if len(parts) > 1 else []
    writes, reads = [], []
    no_dest = op.startswith(('ST', 'RED', 'ATOM', 'BRA', 'BAR', 'EXIT', 'RET', 'SYNCS', 'WARPGROUP', 'ISETP',
                             'FSETP', 'DSETP', 'HSETP', 'UISETP', 'PLOP', 'CALL', 'MEMBAR', 'FENCE', 'UTMA',
                             'NOP', 'WARPSYNC', 'BSYNC', 'BSSY', 'YIELD', 'ERRBAR', 'CCTL', 'DEPBAR', 'ARRIVES'))
    first = 0
    while first < len(ops) and re.fullmatch(r'!?U?P[T0-9]+', ops[first]):
        first += 1  # predicate destinations (e.g. "LOP3.LUT P0, R5, ...")
    if op.startswith('HGMMA'):
        m = re.match(r'(\d+)x(\d+)x(\d+)', op.split('.', 1)[1])
        n = int(m.group(2)) if m else 64
        acc = int(REG.search(ops[0]).group(1))
        writes = list(range(acc, acc + n // 2))  # f32 accumulators of m64nN: N/2 registers
        a = REG.fullmatch(ops[1]) if len(ops) > 1 else None
        if a:
            reads = list(range(int(a.group(1)), int(a.group(1)) + 4))
        reads += writes if len(ops) > 3 and REG.search(ops[3]) else []
        return op, writes, reads, (int(a.group(1)) if a else None)
    if not no_dest and first < len(ops) and REG.fullmatch(ops[first].replace('.reuse', '')):
        d = int(REG.search(ops[first]).group(1))
        writes = list(range(d, d + width(op)))
        rest = ops[first + 1:]
    else:
        rest = ops
    for o in rest:
        for m in REG.finditer(o):
            r = int(m.group(1))
            w = width(op) if (op.startswith('ST') and '[' not in o) else 1
            reads += list(range(r, r + w))
    return op, writes, reads, None


def check(path):
    funcs, cur = {}, None
    for line in open(path, errors='replace'):
        f = FUNC.match(line)
        if f:
            cur = f.group(1)
            funcs[cur] = []
            continue
        m = INS.match(line)
        if m and cur is not None:
            funcs[cur].append((int(m.group(1), 16), m.group(2)))
    findings = 0
    for name, body_all in funcs.items():
        dec = [(a, s, *parse(s)) for a, s in body_all]
        # The out-of-line retry paths of mbarrier waits sit after the function's last EXIT and
        # branch back into the code: not loops.
        last_exit = max((a for a, s, o, *_ in dec if o.startswith('EXIT')), default=1 << 62)
        for i, (addr, text, op, *_r) in enumerate(dec):
            b = re.search(r'BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)', text)
            if not b or int(b.group(1), 16) >= addr or addr > last_exit:
                continue
            lo = int(b.group(1), 16)
            body = [x for x in dec if lo <= x[0] <= addr]
            if not any(x[2].startswith('HGMMA') for x in body):
                continue
            written, carried = set(), {}
            for a, s, o, w, rd, abase in body:
                if abase is not None:
                    for r in range(abase, abase + 4):
                        if r not in written:
                            carried.setdefault(r, a)
                written.update(w)
            for r, use in sorted(carried.items()):
                last = max((k for k, x in enumerate(body) if r in x[3]), default=None)
                if last is None:
                    continue  # never written in the loop: a fixed operand, as it should be
                later = [x for x in body[last + 1:] if r in x[4]]
                if later:
                    findings += 1
                    print(f"{path}: {name}: loop 0x{lo:x}-0x{addr:x}: R{r} is the A operand of the HGMMA at "
                          f"0x{use:x} on entry, but its last write in the loop (0x{body[last][0]:x}: "
                          f"{body[last][1]}) is read again in the loop (0x{later[0][0]:x}: {later[0][1]})")
    return findings


# --self-test: two miniature kernels in cuobjdump's format. "bad": the loop's first HGMMA reads
# R152 (fixed before the loop), and inside the loop R152 is rewritten with a fragment that a
# second HGMMA reads (the fault). "good": the same with the fixed fragment refreshed by an XOR
# at the end of the loop, plus a loop-carried fragment (R120) written last and read only at the
# loop head, as the forward kernels do.
_SELF = {
    "bad": """
        Function : bad
        /*0000*/                   LDS R152, [R6] ;
        /*0010*/                   HGMMA.64x64x8.F32.TF32 R56, R152, gdesc[UR12], RZ, !UPT ;
        /*0020*/                   LOP3.LUT R152, R56, 0xffffe000, RZ, 0xc0, !PT ;
        /*0030*/                   HGMMA.64x64x8.F32.TF32 R120, R152, gdesc[UR12], R120 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
""",
    "good": """
        Function : good
        /*0000*/                   LDS R152, [R6] ;
        /*0010*/                   HGMMA.64x64x8.F32.TF32 R56, R152, gdesc[UR12], RZ, !UPT ;
        /*0020*/                   HGMMA.64x64x8.F32.TF32 R24, R120, gdesc[UR12], R24 ;
        /*0030*/                   LOP3.LUT R200, R56, 0xffffe000, RZ, 0xc0, !PT ;
        /*0040*/                   HGMMA.64x64x8.F32.TF32 R88, R200, gdesc[UR12], R88 ;
        /*0050*/                   LOP3.LUT R120, R57, 0xffffe000, RZ, 0xc0, !PT ;
        /*0060*/                   LOP3.LUT R152, R152, UR13, RZ, 0x3c, !PT ;
        /*0070*/              @!P0 BRA 0x10 ;
        /*0080*/                   EXIT ;
        /*0090*/                   BRA 0x10 ;
""",
}


def self_test():
    import os
    import tempfile
    found = {}
    for name, text in _SELF.items():
        with tempfile.NamedTemporaryFile("w", suffix=".sass", delete=False) as f:
            f.write(text)
        try:
            found[name] = check(f.name)
        finally:
            os.unlink(f.name)
    ok = found["bad"] == 1 and found["good"] == 0  # R152, the one register the bad loop rewrites
    print(f"self-test: bad {found['bad']} finding(s) (want 1), good {found['good']} (want 0):",
          "ok" if ok else "FAILED")
    return 0 if ok else 1


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    if sys.argv[1] == "--self-test":
        return self_test()
    n = sum(check(p) for p in sys.argv[1:])
    print(f"check-sass-wgmma: {n} finding(s) in {len(sys.argv) - 1} file(s)")
    return 1 if n else 0


if __name__ == '__main__':
    sys.exit(main())
