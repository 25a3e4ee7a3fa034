"""The one compiled part: services/common/_wordcopy.c (checksum.py says what it does and how it is used).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is at hand the build
goes on without it and checksum.py uses its torch path (same values, slower: `checksum.NATIVE` tells which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("services.common._wordcopy", ["services/common/_wordcopy.c"],
                             extra_compile_args=["-O3"], optional=True)])
