"""Math-answer helpers shared by the rules: extraction, normalisation, exact and symbolic equality.

- `extract`: the last `\\boxed{}` (ours and mathruler's), the last `Answer:` line, the final answer;
- `answer_values`: value-keeping normalisation and exact values of numbers, tuples, sets and lists;
- `structure`: inequalities, intervals, `\\pm`, named lists, numbers in a base, matrices;
- `sympy_parse`: the one sympy expression parse, used by `algebra` (polynomials, rational functions)
  and `expressions` (roots, sequences, finite sums);
- `symbolic`: HuggingFace math-verify with its signal-based timeouts off;
- `equivalence`: when two answers are equal (the fast path above, then math-verify);
- `minerva`: Minerva's answer normalisation (DAPO's rule).
"""
