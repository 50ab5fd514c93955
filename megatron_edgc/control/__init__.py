"""How the rank is chosen: entropy (GDS, EDGC §2), rank model (CQM, §4), the paper's
controller (warm-up and windows, §3 and §5), the budget controller, stage alignment (DAC,
§6), and the one interface the driver calls (``rank_control``). Pure: fed numbers,
returns ranks; no process groups, no megatron."""
