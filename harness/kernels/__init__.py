"""The Triton kernels' compiled figures: the compile table for named GPU targets on a machine without a
GPU (``kernel_table``) and its diff against another revision (``kernel_diff``).

May import: common, variants."""
