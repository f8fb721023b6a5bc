// Shared by the weight-only matmul kernels (int8_linear.cpp, int4_linear.cpp): the rows of
// x go through a kernel's tile function in blocks of up to 4, the block size a compile-time
// constant so that its accumulators stay in registers.
#pragma once

#include <cstdint>
#include <type_traits>

// Calls tile(std::integral_constant<int, MB>{}, m0) for m0 = 0, 4, 8, ... over M rows: blocks
// of 4, then one block of the 1-3 rows left.
template <typename Tile>
inline void for_row_blocks(int64_t M, Tile&& tile) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile(std::integral_constant<int, 4>{}, m0);
  switch (M - m0) {
    case 3: tile(std::integral_constant<int, 3>{}, m0); break;
    case 2: tile(std::integral_constant<int, 2>{}, m0); break;
    case 1: tile(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}
