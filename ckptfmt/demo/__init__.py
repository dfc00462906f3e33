"""The README's demo: a training run killed part-way and resumed bit-exactly.

``python -m ckptfmt.demo``.  May import any layer.
"""
