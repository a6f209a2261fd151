set -e
G=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S llama.cpp -B build -G "$G" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON \
  "-DCMAKE_C_FLAGS=$NOAMX" "-DCMAKE_CXX_FLAGS=$NOAMX" > build.log 2>&1
cmake --build build -j "${JOBS:-2}" --target llama >> build.log 2>&1
ls build/bin
