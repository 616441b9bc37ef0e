"""Program -> Program rewrites, one per file (DESIGN.md, Passes)."""
