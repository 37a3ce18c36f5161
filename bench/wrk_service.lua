-- wrk script for bench/service_bench.py (wrk 4.x, LuaJIT).
--
--   wrk -t1 -c50 -d10s -s bench/wrk_service.lua http://127.0.0.1:PORT -- \
--       get /healthz 200
--   wrk ... -- post /v1/decisions 201 TEMPLATE_FILE RUN_TOKEN [RUN_SIZE]
--
-- "get": every request is `GET <path>`.
-- "post": every request is `POST <path>` with Content-Type: application/json and
-- the JSON body read from TEMPLATE_FILE, where every "@ID@" is replaced by an id
-- unique to this request: RUN_TOKEN-<thread>-<counter>. RUN_TOKEN must be new for
-- every wrk invocation, so no two requests of a run ever share a decision id.
-- With RUN_SIZE (bench/engine_relay_bench.py), every "@RUN@" is replaced by a run
-- id shared by RUN_SIZE consecutive requests of a thread: RUN_TOKEN-<thread>-r<n>.
--
-- Each response's status is compared with the expected one (200 or 201); done()
-- prints one line "WRK_JSON {...}" with the counts, the duration and the latency
-- percentiles in microseconds, which service_bench.py parses.

local threads = {}

function setup(thread)
   thread:set("tid", #threads)
   table.insert(threads, thread)
end

local mode, path, expected, parts, token, run_size
local counter = 0
ok, bad, first_bad = 0, 0, 0

local function read_file(name)
   local f = assert(io.open(name, "rb"), "cannot open body template " .. tostring(name))
   local text = f:read("*a")
   f:close()
   return text
end

local function split(text, sep)
   local out, start = {}, 1
   while true do
      local i, j = string.find(text, sep, start, true)
      if not i then
         table.insert(out, string.sub(text, start))
         return out
      end
      table.insert(out, string.sub(text, start, i - 1))
      start = j + 1
   end
end

local static_request

function init(args)
   mode, path, expected = args[1], args[2], tonumber(args[3])
   if mode == "post" then
      parts = split(read_file(args[4]), "@ID@")
      token = args[5] .. "-" .. tostring(tid)
      run_size = tonumber(args[6] or "0")
   elseif mode == "get" then
      static_request = wrk.format("GET", path)
   else
      error("mode must be get or post, got " .. tostring(mode))
   end
end

local post_headers = { ["Content-Type"] = "application/json" }

function request()
   if static_request then
      return static_request
   end
   counter = counter + 1
   local body = table.concat(parts, token .. "-" .. counter)
   if run_size > 0 then
      local run = token .. "-r" .. tostring(math.floor((counter - 1) / run_size))
      body = string.gsub(body, "@RUN@", run)
   end
   return wrk.format("POST", path, post_headers, body)
end

function response(status, headers, body)
   if status == expected then
      ok = ok + 1
   else
      bad = bad + 1
      if first_bad == 0 then
         first_bad = status
      end
   end
end

function done(summary, latency, requests)
   local ok_total, bad_total, first = 0, 0, 0
   for _, thread in ipairs(threads) do
      ok_total = ok_total + thread:get("ok")
      bad_total = bad_total + thread:get("bad")
      if first == 0 then
         first = thread:get("first_bad")
      end
   end
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"duration_us":%d,"requests":%d,"ok":%d,"bad":%d,"first_bad_status":%d,' ..
      '"connect_errors":%d,"read_errors":%d,"write_errors":%d,"timeouts":%d,' ..
      '"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f}\n',
      summary.duration, summary.requests, ok_total, bad_total, first,
      e.connect, e.read, e.write, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99),
      latency.max, latency.mean))
end
