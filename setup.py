"""Build only: the Cython kernels (batch formation, a decision's arithmetic, the prompt
featuriser, LightGBM's single-row calls). Metadata lives in pyproject.toml."""

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("olproute._core", ["olproute/_core.pyx"], include_dirs=[np.get_include()]),
         Extension("olproute._score", ["olproute/_score.pyx"], include_dirs=[np.get_include()]),
         Extension("olproute._featurize", ["olproute/_featurize.pyx"]),
         Extension("olproute._rowheads", ["olproute/_rowheads.pyx"])],
        compiler_directives={"language_level": "3"},
    )
)
