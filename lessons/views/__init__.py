"""Figures and widgets, one module per lesson. Views read traces and results; they never do
attention maths of their own."""
