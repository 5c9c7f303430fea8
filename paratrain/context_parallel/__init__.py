"""Context parallelism: every sequence's positions split over the ``cp`` ranks (docs/context_parallel.md).

``split.py`` says which positions a rank holds (the head-tail balance), ``ring.py`` is ring
attention over the cp group, ``apply.py`` routes a family's attention through it.
"""
