"""The token mixers `commfuse.tp.parallelize` plans as a whole, each a `ParallelStyle` that
runs the model module's own code on this rank's heads: Mamba-2 mixers (`mamba`), Gated
DeltaNet linear attention (`deltanet`) and multi-head latent attention (`mla`)."""
