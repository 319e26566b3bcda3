"""Checks: `toolkit parity` (`capture` records a few steps of a run, `parity` compares two records),
`toolkit compare` of finished runs (`compare`), and `toolkit env`, what will run where (`env`)."""
