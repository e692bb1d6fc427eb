-- wrk script: POST the bodies of a manifest in turn (each thread starts at its own
-- offset), and print one JSON line of results at the end.
-- usage: wrk -s loadgen.lua URL -- MANIFEST
local bodies = {}
local counter = 0

function init(args)
  for line in io.lines(args[1]) do
    local path, header_length = line:match("^(%S+) (%d+)$")
    local f = assert(io.open(path, "rb"))
    local body = f:read("*a")
    f:close()
    local headers = {["Content-Type"] = "application/json"}
    if tonumber(header_length) > 0 then
      headers["Content-Type"] = "application/octet-stream"
      headers["Inference-Header-Content-Length"] = header_length
    end
    table.insert(bodies, wrk.format("POST", nil, headers, body))
  end
  counter = math.random(#bodies)
end

function request()
  counter = counter % #bodies + 1
  return bodies[counter]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {"requests":%d,"duration_us":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,' ..
    '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
