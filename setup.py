"""Build only: the Cython kernels (batch formation, a decision's arithmetic, the prompt
featuriser, LightGBM's single-row calls). Metadata lives in pyproject.toml."""

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("olproute._core", ["olproute/_core.pyx"], include_dirs=[np.get_include()]),
         Extension("olproute.pricing._score", ["olproute/pricing/_score.pyx"],
                   include_dirs=[np.get_include()]),
         Extension("olproute.predict._featurize", ["olproute/predict/_featurize.pyx"]),
         Extension("olproute.predict._rowheads", ["olproute/predict/_rowheads.pyx"])],
        compiler_directives={"language_level": "3"},
    )
)
