#include <gtest/gtest.h>

#include "framefit/core/runtime.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  framefit::configure_runtime();
  return RUN_ALL_TESTS();
}
