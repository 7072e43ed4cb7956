#!/bin/bash
# Builds llama.cpp's Vulkan llama-bench from the kit's source into /tmp/lc/src/bvk (GPU machine;
# about 3 minutes on 16 cores), logging to /tmp/lc/vk.log, whose last line is "vk rc N".
# Source it after .device/enter.sh and run `build_llamacpp_vulkan &`, then `wait` for it.
build_llamacpp_vulkan() {
  local kit=.device/peers/llamacpp R=/tmp/lc/root/usr
  mkdir -p /tmp/lc/root && tar xzf $kit/llama.cpp-*-src.tgz -C /tmp/lc && mv /tmp/lc/lcsrc /tmp/lc/src
  for f in $kit/debs/*.deb; do dpkg -x "$f" /tmp/lc/root; done
  ( cd /tmp/lc/src && export LD_LIBRARY_PATH=$R/lib/x86_64-linux-gnu && \
    cmake -B bvk -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -G Ninja -DGGML_VULKAN=ON \
      -DCMAKE_PREFIX_PATH=$R -DVulkan_INCLUDE_DIR=$R/include -DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 \
      -DVulkan_GLSLC_EXECUTABLE=$R/bin/glslc > /tmp/lc/vk.log 2>&1 && cmake --build bvk -j 14 --target llama-bench >> /tmp/lc/vk.log 2>&1; \
    echo "vk rc $?" >> /tmp/lc/vk.log )
}
