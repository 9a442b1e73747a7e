"""The plan layer: a schedule lowered to per-rank instructions (``program``, ``lower``), the
``.opb`` bytecode file (``bytecode``), the verifier that proves a plan cannot deadlock
(``verify``), the disassembler (``disasm``), and PyTorch's schedule CSV (``torch_csv``).

It reads the core layer and nothing above it; the runtime executes what it produces.
"""
