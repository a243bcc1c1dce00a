"""The CPU contract kernel sets: `invariant` (contract v1, exact fixed-point GEMMs) and `ordered` (contract
v2, fp32 chains in an order the compiled sources own), their GEMMs, attention, linears and host check."""
