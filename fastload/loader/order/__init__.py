"""The order of an epoch and the place in it: one floor below every loader.

The global order (:mod:`._order`, a pure function of seed, epoch, shard sizes and shuffle options)
over keyed permutations (:mod:`._permute`), its partition into global steps, rank batches and
worker tasks (:mod:`._partition`), every seed (:mod:`._seeds`) and per-sample generator
(:mod:`._sample_rng`), and the resumable cursor all loaders keep (:mod:`._cursor`, over the
:class:`~fastload.loader.order._cursor.Resumable` protocol) with its counters (:mod:`._stats`).
Nothing here reads data: it imports no other room of the loader.
"""
