"""The image layouts of the LLaVA architecture, named once for the records and the graph."""

SINGLE, ANYRES, ONEVISION = "single", "anyres", "onevision"
"""How a record's model lays an image out (`graph.image_layout`, bound in its hooks with
`functools.partial`): LLaVA-1.5's one native crop, LLaVA-NeXT's anyres tiles + base crop
(concatenated into one pixel tensor, packed features, `image_newline`), OneVision's anyres
with anyres_max_N downsampling."""
